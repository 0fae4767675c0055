//! Prompt lookup replayed offline: for every position of real answers (ShareGPT's first
//! assistant turns, after their chat-rendered prompts, in a model's tokenizer), what a lookup tree
//! of `--nodes` nodes merging the `--branches` most recent occurrences of the matched suffix would
//! have accepted had that answer been the target's greedy output. No model runs: it measures the
//! proposals alone, the figure `PromptLookup::max_branches` was chosen by.

use std::path::PathBuf;

use clap::Parser;
use glance_input::{ChatMessage, ContentPart, PromptBuilder, PromptOptions};
use glance_spec::prompt_lookup::PromptLookup;
use glance_spec::tree::TokenId;

#[derive(Parser)]
#[command(
    about = "Prompt lookup replayed on ShareGPT answers: tokens accepted per position by merged occurrences"
)]
struct Args {
    /// The model directory whose tokenizer and chat template render the prompts.
    #[arg(long, default_value = "models/smollm2-135m-instruct")]
    model: PathBuf,
    #[arg(long, default_value = "data/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json")]
    data: PathBuf,
    /// Conversations replayed (the training split's first ones with an answer).
    #[arg(long, default_value_t = 300)]
    conversations: usize,
    /// Answer tokens replayed per conversation.
    #[arg(long, default_value_t = 128)]
    answer_tokens: usize,
    /// Most nodes of a proposal (and tokens on one path).
    #[arg(long, default_value_t = 15)]
    nodes: usize,
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 2, 4, 8])]
    branches: Vec<usize>,
    /// Longest suffix n-gram tried (shorter ones after it).
    #[arg(long, default_value_t = PromptLookup::new(1).max_ngram)]
    max_ngram: usize,
}

fn main() {
    let args = Args::parse();
    let corpus =
        drafter_svc::sharegpt::read(&args.data).expect("the ShareGPT file (scripts/setup-real-model.sh)");
    let builder =
        PromptBuilder::from_model_dir(&args.model, PromptOptions::default()).expect("the tokenizer");
    let mut accepted = vec![0usize; args.branches.len()];
    let (mut positions, mut matched) = (0usize, 0usize);
    let pairs = corpus.train.iter().filter_map(|p| p.answer.as_ref().map(|a| (&p.text, a)));
    for (prompt, answer) in pairs.take(args.conversations) {
        let user = ChatMessage { role: "user".into(), content: vec![ContentPart::Text(prompt.clone())] };
        let rendered = builder.build(&[user]).expect("prompt").model_inputs().input_ids;
        let encoded = builder.tokenizer().encode(answer.as_str(), false).expect("answer tokens");
        let answer: Vec<TokenId> = encoded.get_ids().iter().take(args.answer_tokens).copied().collect();
        let mut history: Vec<TokenId> = rendered.iter().map(|&t| t as TokenId).collect();
        for (t, &root) in answer.iter().enumerate() {
            // The history ends with the root; the target would go on with the rest of the answer.
            history.push(root);
            let truth = &answer[t + 1..(t + 1 + args.nodes).min(answer.len())];
            positions += 1;
            let found = args.branches.iter().map(|&b| {
                let lookup = PromptLookup {
                    max_branches: b,
                    max_nodes: args.nodes,
                    max_ngram: args.max_ngram,
                    ..PromptLookup::new(args.nodes)
                };
                lookup.find(&history).map(|(_, tree)| tree.followed(truth))
            });
            let found: Vec<Option<usize>> = found.collect();
            if found.iter().any(Option::is_some) {
                matched += 1;
            }
            for (total, f) in accepted.iter_mut().zip(found) {
                *total += f.unwrap_or(0);
            }
        }
    }
    println!(
        "{positions} answer positions, {matched} with a matching suffix of at most {} tokens; {} nodes a proposal\n\n| occurrences merged | tokens accepted per matched position | per position |\n|---|---|---|",
        args.max_ngram, args.nodes
    );
    for (b, total) in args.branches.iter().zip(accepted) {
        let per = |n: usize| total as f64 / n.max(1) as f64;
        println!("| {b} | {:.3} | {:.3} |", per(matched), per(positions));
    }
}

//! The losslessness prompt suite: prompts with and without images for the tiny reference models,
//! their greedy outputs computed in process (the ground truth every speculative mode must equal),
//! and the oracle file the test oracle drafter reads.

use std::path::Path;

use glance_input::{ChatMessage, ContentPart, PromptBuilder, PromptOptions};
use glance_models::decode::{greedy_generate, GreedyParams, StepControl};
use glance_models::TargetModel;
use glance_proto::v1 as pb;

const TEXTS: [&str; 13] = [
    "Describe the image.",
    "What colours do you see?",
    "Read the sign and repeat it twice.",
    "List every shape, one per line.",
    "Write a short story about a red square and a blue circle.",
    "Count the objects and explain how you counted them.",
    "Transcribe the document exactly.",
    "What is the largest number in the chart?",
    "Continue: once upon a time, in a city of numbers,",
    "Summarize the picture in three words, then in one sentence.",
    "Is there any text? Copy it.",
    "Compare the left side with the right side.",
    "Tell me everything about the figure.",
];
const IMAGES: [&str; 4] = ["square.png", "wide.png", "odd.jpg", "big.png"];

/// One prompt of the suite.
pub struct SuitePrompt {
    pub messages: Vec<ChatMessage>,
    pub max_new_tokens: u32,
    /// Keep generating past EOS (long outputs) or stop at it (exercises EOS inside accepted runs).
    pub ignore_eos: bool,
    /// Greedy output, computed in process.
    pub greedy: Vec<i64>,
    /// Prompt token ids (for the oracle file).
    pub prompt_ids: Vec<i64>,
}

/// `count` prompts for the model in `dir` (a fixture directory; a VLM's has `reference/images/`):
/// for a VLM every other prompt carries an image, and every third one stops at EOS.
pub fn build(dir: &Path, count: usize, max_new_tokens: u32) -> Vec<SuitePrompt> {
    let prompts = PromptBuilder::from_model_dir(dir, PromptOptions::default()).expect("prompt builder");
    let model = TargetModel::load(dir, tch::Kind::Float, crate::test_device()).expect("model");
    let eos: Vec<i64> = prompts.eos_token_ids().iter().map(|&i| i as i64).collect();
    (0..count)
        .map(|i| {
            let mut content = Vec::new();
            if i % 2 == 1 && prompts.takes_images() {
                let path = dir.join("reference/images").join(IMAGES[(i / 2) % IMAGES.len()]);
                content.push(ContentPart::Image {
                    data: std::fs::read(path).expect("image"),
                    mime_type: String::new(),
                });
            }
            content.push(ContentPart::Text(format!("{} (#{i})", TEXTS[i % TEXTS.len()])));
            let messages = vec![ChatMessage { role: "user".into(), content }];
            let ignore_eos = i % 3 != 0;
            let prompt = prompts.build(&messages).expect("prompt");
            let inputs = prompt.model_inputs();
            let params = GreedyParams {
                max_new_tokens: max_new_tokens as usize,
                eos_token_ids: if ignore_eos { &[] } else { &eos },
                context_limit: 4096,
                logprobs: None,
            };
            let greedy =
                greedy_generate(&model, &inputs, &params, |_| StepControl::Continue).expect("greedy").tokens;
            SuitePrompt { messages, max_new_tokens, ignore_eos, greedy, prompt_ids: inputs.input_ids }
        })
        .collect()
}

/// JSON for the test oracle drafter: each prompt's ids followed by its greedy output.
pub fn oracle_json(suite: &[SuitePrompt]) -> String {
    let sequences: Vec<Vec<i64>> =
        suite.iter().map(|p| p.prompt_ids.iter().chain(&p.greedy).copied().collect()).collect();
    serde_json::to_string(&sequences).expect("oracle json")
}

/// The gRPC request of a suite prompt in the given mode.
pub fn request(prompt: &SuitePrompt, mode: pb::DecodingMode, tree_budget: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        messages: to_proto(&prompt.messages),
        max_new_tokens: prompt.max_new_tokens,
        stop: vec![],
        decoding: Some(pb::DecodingOptions {
            mode: mode as i32,
            tree_budget,
            branch_k: 0,
            ignore_eos: prompt.ignore_eos,
            ..Default::default()
        }),
    }
}

pub fn to_proto(messages: &[ChatMessage]) -> Vec<pb::ChatMessage> {
    messages
        .iter()
        .map(|m| pb::ChatMessage {
            role: m.role.clone(),
            content: m
                .content
                .iter()
                .map(|part| pb::ContentPart {
                    part: Some(match part {
                        ContentPart::Text(t) => pb::content_part::Part::Text(t.clone()),
                        ContentPart::Image { data, mime_type } => pb::content_part::Part::Image(pb::Image {
                            data: data.clone(),
                            mime_type: mime_type.clone(),
                        }),
                    }),
                })
                .collect(),
        })
        .collect()
}

//! `glance`: a small command-line client of the public API (generate, stream, model info).

use std::path::PathBuf;
use std::time::Instant;

use clap::{Parser, Subcommand};
use glance_proto::v1 as pb;
use glance_proto::v1::generation_client::GenerationClient;

#[derive(Parser)]
#[command(name = "glance", version, about = "Client for a glance verifier-svc")]
struct Cli {
    /// Address of verifier-svc.
    #[arg(long, env = "GLANCE_ADDR", default_value = "http://127.0.0.1:50051")]
    addr: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// One request; prints the answer, usage and timings.
    Generate(GenerateArgs),
    /// Like generate, printing text as it streams in.
    Stream(GenerateArgs),
    /// Prints the served model and its limits.
    Info,
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// The user's text.
    #[arg(long)]
    prompt: String,
    /// Image files, placed before the text in the user message.
    #[arg(long = "image")]
    images: Vec<PathBuf>,
    /// An optional system message.
    #[arg(long)]
    system: Option<String>,
    #[arg(long, default_value_t = 128)]
    max_new_tokens: u32,
    /// Stop strings.
    #[arg(long = "stop")]
    stop: Vec<String>,
    /// Print the response as JSON (token ids included).
    #[arg(long)]
    json: bool,
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli).await {
        eprintln!("glance: {e}");
        std::process::exit(1);
    }
}

async fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    let mut client = GenerationClient::connect(cli.addr.clone())
        .await?
        .max_decoding_message_size(64 * 1024 * 1024);
    match cli.command {
        Command::Info => {
            let info = client
                .model_info(pb::ModelInfoRequest {})
                .await?
                .into_inner();
            println!("{info:#?}");
        }
        Command::Generate(args) => {
            let request = build_request(&args)?;
            let started = Instant::now();
            let response = client.generate(request).await?.into_inner();
            if args.json {
                print_json(&response);
            } else {
                println!("{}", response.text);
                print_summary(
                    response.finish_reason,
                    response.usage,
                    response.timings,
                    started,
                );
            }
        }
        Command::Stream(args) => {
            let request = build_request(&args)?;
            let started = Instant::now();
            let mut stream = client.generate_stream(request).await?.into_inner();
            let mut last = None;
            while let Some(chunk) = stream.message().await? {
                use std::io::Write;
                print!("{}", chunk.text);
                std::io::stdout().flush()?;
                if chunk.finish_reason != 0 {
                    last = Some(chunk);
                }
            }
            println!();
            if let Some(last) = last {
                print_summary(last.finish_reason, last.usage, last.timings, started);
            }
        }
    }
    Ok(())
}

fn build_request(args: &GenerateArgs) -> Result<pb::GenerateRequest, Box<dyn std::error::Error>> {
    let mut messages = Vec::new();
    if let Some(system) = &args.system {
        messages.push(text_message("system", system));
    }
    let mut content = Vec::new();
    for path in &args.images {
        let data = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let image = pb::Image {
            data,
            mime_type: String::new(),
        };
        content.push(pb::ContentPart {
            part: Some(pb::content_part::Part::Image(image)),
        });
    }
    content.push(pb::ContentPart {
        part: Some(pb::content_part::Part::Text(args.prompt.clone())),
    });
    messages.push(pb::ChatMessage {
        role: "user".into(),
        content,
    });
    Ok(pb::GenerateRequest {
        messages,
        max_new_tokens: args.max_new_tokens,
        stop: args.stop.clone(),
        decoding: None,
    })
}

fn text_message(role: &str, text: &str) -> pb::ChatMessage {
    pb::ChatMessage {
        role: role.into(),
        content: vec![pb::ContentPart {
            part: Some(pb::content_part::Part::Text(text.into())),
        }],
    }
}

fn print_summary(
    finish: i32,
    usage: Option<pb::Usage>,
    timings: Option<pb::Timings>,
    started: Instant,
) {
    let finish = pb::FinishReason::try_from(finish)
        .map(|f| f.as_str_name())
        .unwrap_or("?");
    let usage = usage.unwrap_or_default();
    let timings = timings.unwrap_or_default();
    println!(
        "-- finish {finish} | prompt {} tokens ({} image) | generated {} | prefill {:.1} ms | decode {:.1} ms ({:.1} tok/s) | wall {:.1} ms",
        usage.prompt_tokens,
        usage.image_tokens,
        usage.generated_tokens,
        timings.prefill_ms,
        timings.decode_ms,
        timings.decode_tokens_per_second,
        started.elapsed().as_secs_f64() * 1e3
    );
}

fn print_json(response: &pb::GenerateResponse) {
    let usage = response.usage.unwrap_or_default();
    let timings = response.timings.unwrap_or_default();
    let value = serde_json::json!({
        "text": response.text,
        "token_ids": response.token_ids,
        "finish_reason": pb::FinishReason::try_from(response.finish_reason).map(|f| f.as_str_name()).unwrap_or("?"),
        "usage": {"prompt_tokens": usage.prompt_tokens, "image_tokens": usage.image_tokens, "generated_tokens": usage.generated_tokens},
        "timings": {"prefill_ms": timings.prefill_ms, "decode_ms": timings.decode_ms, "decode_tokens_per_second": timings.decode_tokens_per_second},
    });
    println!("{value}");
}

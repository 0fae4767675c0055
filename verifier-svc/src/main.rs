use clap::Parser;
use verifier_svc::config::Args;
use verifier_svc::server;

#[tokio::main]
async fn main() {
    let args = Args::parse();
    if args.print_fingerprint {
        match server::checked_fingerprint(&args) {
            Ok(fingerprint) => println!("{fingerprint}"),
            Err(e) => {
                eprintln!("verifier-svc: {e}");
                std::process::exit(1);
            }
        }
        return;
    }
    let telemetry = match glance_telemetry::init("verifier-svc") {
        Ok(t) => t,
        Err(e) => {
            eprintln!("verifier-svc: {e}");
            std::process::exit(1);
        }
    };
    let result = run(args).await;
    // Spans of the last requests go out before the process ends.
    telemetry.shutdown();
    if let Err(e) = result {
        eprintln!("verifier-svc: {e}");
        std::process::exit(1);
    }
}

async fn run(args: Args) -> Result<(), server::StartupError> {
    let started = std::time::Instant::now();
    if args.metrics_listen != "off" {
        let addr = args.metrics_listen.parse().map_err(|e| {
            server::StartupError::Metrics(format!("--metrics-listen {}: {e}", args.metrics_listen))
        })?;
        glance_telemetry::serve_metrics(addr, &verifier_svc::metrics::buckets())
            .map_err(|e| server::StartupError::Metrics(e.to_string()))?;
        verifier_svc::metrics::register();
    }
    // Loading is blocking work (reading and converting weights).
    let load_args = args.clone();
    let loaded = tokio::task::spawn_blocking(move || server::load(&load_args))
        .await
        .map_err(|e| server::StartupError::Serve(e.to_string()))??;
    let listener = server::bind(&args).await?;
    let addr = listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
    tracing::info!(%addr, model = %args.model.display(), load_s = started.elapsed().as_secs_f64(), "serving");
    // Scripts wait for this line on stdout.
    println!("verifier-svc listening on {addr}");
    server::serve(loaded, listener, shutdown_signal()).await?;
    tracing::info!("drained; exiting");
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing the SIGTERM handler");
    tokio::select! {
        _ = ctrl_c => {},
        _ = term.recv() => {},
    }
}

//! glance-telemetry: logs, traces and metrics for both services — a tracing subscriber that exports spans over
//! OTLP/gRPC when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set,
//! W3C trace-context propagation through gRPC metadata (the one helper both sides use), and the
//! Prometheus exporter on its own HTTP port.

use std::net::SocketAddr;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("OTLP exporter: {0}")]
    Exporter(String),
    #[error("metrics exporter on {addr}: {reason}")]
    Metrics { addr: SocketAddr, reason: String },
}

/// The target of the spans opened for every decoding round (the verifier's `round`, `draft`,
/// `draft_wait`, `verify`, `commit`; the drafter's `draft_round`). They go to the trace exporter,
/// but the log layer sees them only with `GLANCE_LOG_SPANS=1`: the log layer formats a span's fields
/// when it opens, and on a small target, whose greedy step takes well under a millisecond, that
/// was 1–2% of auto's decoding time (measured on the toy world's doc request).
pub const ROUND_SPANS: &str = "glance_round";

/// Keeps the trace pipeline alive; [`Telemetry::shutdown`] flushes it.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether spans are exported (an OTLP endpoint is configured).
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Flushes the spans still buffered and stops the exporter (on shutdown).
    pub fn shutdown(&self) {
        if let Some(provider) = &self.provider {
            if let Err(e) = provider.force_flush() {
                eprintln!("flushing traces failed: {e}");
            }
            let _ = provider.shutdown();
        }
    }
}

fn otlp_configured() -> bool {
    ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
        .iter()
        .any(|k| std::env::var(k).is_ok_and(|v| !v.is_empty()))
        && std::env::var("OTEL_SDK_DISABLED").as_deref() != Ok("true")
}

/// Installs the global subscriber: `RUST_LOG`-filtered logs to stderr (span timings too with
/// `GLANCE_LOG_SPANS=1`), plus OTLP span export when
/// an endpoint is set (`OTEL_*` variables honoured by the exporter; service name from
/// `OTEL_SERVICE_NAME`, else `default_service`). Must run inside the tokio runtime.
pub fn init(default_service: &str) -> Result<Telemetry, TelemetryError> {
    use tracing_subscriber::Layer as _;
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    // Logs and exported spans are filtered apart: quiet logs (RUST_LOG=warn) must not switch the
    // request/round spans off. `GLANCE_TRACE_FILTER` selects the exported spans (default info).
    let mut log_filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    // `GLANCE_LOG_SPANS=1` also logs every span's busy and idle time when it closes: where a
    // request's time goes (prefill, each round's draft, verify and commit) without a collector.
    // Without it the log layer leaves the round spans alone (see `ROUND_SPANS`).
    let span_events = if std::env::var("GLANCE_LOG_SPANS").is_ok_and(|v| v == "1") {
        tracing_subscriber::fmt::format::FmtSpan::CLOSE
    } else {
        let quiet = format!("{ROUND_SPANS}=off").parse().expect("a valid directive");
        log_filter = log_filter.add_directive(quiet);
        tracing_subscriber::fmt::format::FmtSpan::NONE
    };
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_span_events(span_events)
        .with_filter(log_filter);
    let registry = tracing_subscriber::registry().with(fmt);
    if !otlp_configured() {
        registry.init();
        return Ok(Telemetry { provider: None });
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()
        .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
    let service = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| default_service.to_string());
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(opentelemetry_sdk::Resource::builder().with_service_name(service.clone()).build())
        .build();
    let tracer = provider.tracer(service);
    let trace_filter =
        tracing_subscriber::EnvFilter::try_from_env("GLANCE_TRACE_FILTER").unwrap_or_else(|_| "info".into());
    registry.with(tracing_opentelemetry::layer().with_tracer(tracer).with_filter(trace_filter)).init();
    Ok(Telemetry { provider: Some(provider) })
}

/// Serves Prometheus metrics at `http://addr/metrics`. Must run inside the tokio runtime.
pub fn serve_metrics(addr: SocketAddr, buckets: &[(&str, &[f64])]) -> Result<(), TelemetryError> {
    let err = |reason: String| TelemetryError::Metrics { addr, reason };
    let mut builder = metrics_exporter_prometheus::PrometheusBuilder::new().with_http_listener(addr);
    for (name, values) in buckets {
        builder = builder
            .set_buckets_for_metric(metrics_exporter_prometheus::Matcher::Full(name.to_string()), values)
            .map_err(|e| err(e.to_string()))?;
    }
    builder.install().map_err(|e| err(e.to_string()))
}

struct MetadataInjector<'a>(&'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(key), Ok(value)) =
            (MetadataKey::from_bytes(key.as_bytes()), MetadataValue::try_from(value))
        {
            self.0.insert(key, value);
        }
    }
}

struct MetadataExtractor<'a>(&'a MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(key) => Some(key.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// Writes the W3C `traceparent` of `span` into outgoing gRPC metadata.
pub fn inject_trace_context(span: &tracing::Span, metadata: &mut MetadataMap) {
    let context = span.context();
    TraceContextPropagator::new().inject_context(&context, &mut MetadataInjector(metadata));
}

/// Makes `span` a child of the trace context in incoming gRPC metadata, when there is one.
pub fn continue_trace(span: &tracing::Span, metadata: &MetadataMap) {
    let parent = TraceContextPropagator::new().extract(&MetadataExtractor(metadata));
    use opentelemetry::trace::TraceContextExt as _;
    if parent.span().span_context().is_valid() {
        let _ = span.set_parent(parent);
    }
}

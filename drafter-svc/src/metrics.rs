//! The drafter's Prometheus metrics.

/// Draft streams (generations) open now: the autoscaling signal of the drafter pool.
pub const SESSIONS_OPEN: &str = "glance_drafter_sessions_open";
/// Most draft streams one drafter admits (`--max-sessions`).
pub const SESSIONS_LIMIT: &str = "glance_drafter_sessions_limit";
/// Draft streams refused because the limit was reached.
pub const SESSIONS_REFUSED: &str = "glance_drafter_sessions_refused_total";
/// Rounds answered with a tree.
pub const ROUNDS: &str = "glance_drafter_rounds_total";
/// Rounds that ended their session with an error.
pub const FAILED_ROUNDS: &str = "glance_drafter_failed_rounds_total";
/// Drafter compute per round (head forward + tree), seconds.
pub const DRAFT_LATENCY: &str = "glance_drafter_draft_seconds";

const BUCKETS: &[f64] = &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0];

pub fn buckets() -> Vec<(&'static str, &'static [f64])> {
    vec![(DRAFT_LATENCY, BUCKETS)]
}

/// Registers the help texts and exports every counter and gauge at zero from start-up (the
/// autoscaler and the alerts see the series before the first session).
pub fn register() {
    describe();
    for counter in [SESSIONS_REFUSED, ROUNDS, FAILED_ROUNDS] {
        metrics::counter!(counter).absolute(0);
    }
    metrics::gauge!(SESSIONS_OPEN).set(0.0);
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_gauge!(SESSIONS_OPEN, "Draft streams open now.");
    describe_gauge!(SESSIONS_LIMIT, "Most draft streams this drafter admits.");
    describe_counter!(SESSIONS_REFUSED, "Draft streams refused at the session limit.");
    describe_counter!(ROUNDS, "Rounds answered with a tree.");
    describe_counter!(FAILED_ROUNDS, "Rounds that ended their session with an error.");
    describe_histogram!(DRAFT_LATENCY, Unit::Seconds, "Head forward plus tree building per round.");
}

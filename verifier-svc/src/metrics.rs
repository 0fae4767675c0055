//! The verifier's Prometheus metrics: names, help texts and histogram buckets. The speculative
//! counters are named like vLLM's (`*_spec_decode_num_drafts_total`, …) so dashboards carry over;
//! every counter ends in `_total` (what `promtool check metrics` asks for).

/// Requests by outcome: ok, cancelled, deadline_exceeded, invalid_argument, rejected, unavailable,
/// failed_precondition, error.
pub const REQUESTS: &str = "glance_requests_total";
/// Admitted requests waiting for an engine thread.
pub const QUEUE_SIZE: &str = "glance_queue_size";
/// Generations running now.
pub const RUNNING: &str = "glance_requests_running";
pub const TTFT: &str = "glance_time_to_first_token_seconds";
pub const ITL: &str = "glance_inter_token_latency_seconds";
/// Tokens generated (all modes).
pub const GENERATED_TOKENS: &str = "glance_generated_tokens_total";
/// Drafted rounds (one target verify pass over a tree each).
pub const SPEC_DRAFTS: &str = "glance_spec_decode_num_drafts_total";
/// Draft tokens (tree nodes) sent through verification.
pub const SPEC_DRAFT_TOKENS: &str = "glance_spec_decode_num_draft_tokens_total";
/// Draft tokens accepted and committed.
pub const SPEC_ACCEPTED_TOKENS: &str = "glance_spec_decode_num_accepted_tokens_total";
/// Accepted draft tokens by tree depth (`position` 0 = first drafted offset).
pub const SPEC_ACCEPTED_PER_POS: &str = "glance_spec_decode_num_accepted_tokens_per_pos_total";
/// Tau of the last speculative request (committed tokens per drafted round).
pub const SPEC_TAU: &str = "glance_spec_decode_mean_accepted_length";
/// Rounds decoded as plain greedy steps because no drafter answered in time.
pub const SPEC_FALLBACK_ROUNDS: &str = "glance_spec_decode_fallback_rounds_total";
/// Trees refused as malformed.
pub const SPEC_REJECTED_TREES: &str = "glance_spec_decode_rejected_trees_total";
/// Auto mode: rounds taken as greedy steps without asking the drafter.
pub const AUTO_GREEDY_STEPS: &str = "glance_auto_greedy_steps_total";
/// Auto mode: greedy steps taken while the drafter was drafting (its time hidden behind them).
pub const AUTO_OVERLAPPED_STEPS: &str = "glance_auto_overlapped_steps_total";
/// Auto mode: trees that arrived after the overlapped steps had left them.
pub const AUTO_STALE_TREES: &str = "glance_auto_stale_trees_total";
/// Auto mode: drafted trees of which the policy verified nothing.
pub const AUTO_DECLINED_TREES: &str = "glance_auto_declined_trees_total";
/// Auto mode: tree nodes verified; over the drafter's verified rounds
/// (`glance_spec_decode_num_drafts_total` less `glance_auto_lookup_rounds_total`) the mean tree
/// size.
pub const AUTO_VERIFIED_NODES: &str = "glance_auto_verified_nodes_total";
/// Auto mode: rounds that verified a prompt-lookup chain in place of a greedy step (counted among
/// `glance_spec_decode_num_drafts_total` too).
pub const AUTO_LOOKUP_ROUNDS: &str = "glance_auto_lookup_rounds_total";
/// Auto mode: prompt-lookup tokens accepted (counted among the accepted tokens too).
pub const AUTO_LOOKUP_ACCEPTED: &str = "glance_auto_lookup_accepted_tokens_total";
/// Auto mode: prompt-lookup tokens accepted past the drafter's path in drafted rounds that had a
/// prompt-lookup tree grafted onto theirs (counted among the accepted tokens too).
pub const AUTO_GRAFTED_ACCEPTED: &str = "glance_auto_grafted_lookup_accepted_tokens_total";
/// Auto mode: requests that started from what the last request of the same instruction (prompt
/// text, images aside) learnt, rather than from the latest request's policy with a probe.
pub const AUTO_KNOWN_INSTRUCTIONS: &str = "glance_auto_known_instruction_requests_total";
/// Auto mode: mean |predicted − committed| tokens per verified round, last auto request.
pub const AUTO_CALIBRATION_ERROR: &str = "glance_auto_calibration_error";
/// One drafter round as the verifier sees it: request sent to tree received.
pub const DRAFTER_ROUND_LATENCY: &str = "glance_drafter_round_latency_seconds";
/// Serialized bytes sent to the drafter.
pub const DRAFTER_BYTES: &str = "glance_drafter_hop_bytes_total";
/// 1 while a compatible drafter is connected.
pub const DRAFTER_CONNECTED: &str = "glance_drafter_connected";
/// Drafter pods seen that do not fit this target or the pool (handshakes refused, left out).
pub const DRAFTER_MISMATCHES: &str = "glance_drafter_mismatches_total";

const LATENCY_BUCKETS: &[f64] =
    &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// Histogram buckets per metric.
pub fn buckets() -> Vec<(&'static str, &'static [f64])> {
    vec![(TTFT, LATENCY_BUCKETS), (ITL, LATENCY_BUCKETS), (DRAFTER_ROUND_LATENCY, LATENCY_BUCKETS)]
}

/// Outcomes of `REQUESTS`.
pub const OUTCOMES: &[&str] = &[
    "ok",
    "cancelled",
    "deadline_exceeded",
    "invalid_argument",
    "rejected",
    "unavailable",
    "failed_precondition",
    "error",
];

/// Registers the help texts (shown as `# HELP` lines) and exports every counter and gauge at zero
/// from start-up, so that a dashboard, an alert or an autoscaler sees the series before the first
/// request (a rate over a series that appears later misses its first increments).
pub fn register() {
    describe();
    for outcome in OUTCOMES {
        metrics::counter!(REQUESTS, "outcome" => *outcome).absolute(0);
    }
    for counter in [
        GENERATED_TOKENS,
        SPEC_DRAFTS,
        SPEC_DRAFT_TOKENS,
        SPEC_ACCEPTED_TOKENS,
        SPEC_FALLBACK_ROUNDS,
        SPEC_REJECTED_TREES,
        AUTO_GREEDY_STEPS,
        AUTO_OVERLAPPED_STEPS,
        AUTO_STALE_TREES,
        AUTO_DECLINED_TREES,
        AUTO_VERIFIED_NODES,
        AUTO_LOOKUP_ROUNDS,
        AUTO_LOOKUP_ACCEPTED,
        AUTO_GRAFTED_ACCEPTED,
        AUTO_KNOWN_INSTRUCTIONS,
        DRAFTER_BYTES,
        DRAFTER_MISMATCHES,
    ] {
        metrics::counter!(counter).absolute(0);
    }
    for gauge in [QUEUE_SIZE, RUNNING, SPEC_TAU, AUTO_CALIBRATION_ERROR, DRAFTER_CONNECTED] {
        metrics::gauge!(gauge).set(0.0);
    }
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(REQUESTS, "Requests by outcome.");
    describe_gauge!(QUEUE_SIZE, "Admitted requests waiting for an engine thread.");
    describe_gauge!(RUNNING, "Generations running now.");
    describe_histogram!(TTFT, Unit::Seconds, "Arrival to first generated token.");
    describe_histogram!(ITL, Unit::Seconds, "Time between consecutive generated tokens.");
    describe_counter!(GENERATED_TOKENS, "Tokens generated.");
    describe_counter!(SPEC_DRAFTS, "Drafted rounds (target verify passes over a tree).");
    describe_counter!(SPEC_DRAFT_TOKENS, "Draft tokens (tree nodes) verified.");
    describe_counter!(SPEC_ACCEPTED_TOKENS, "Draft tokens accepted and committed.");
    describe_counter!(
        SPEC_ACCEPTED_PER_POS,
        "Accepted draft tokens by depth (position 0 = first drafted offset)."
    );
    describe_gauge!(SPEC_TAU, "Committed tokens per drafted round, last speculative request.");
    describe_counter!(
        SPEC_FALLBACK_ROUNDS,
        "Rounds decoded as greedy steps because no drafter answered in time."
    );
    describe_counter!(SPEC_REJECTED_TREES, "Trees refused as malformed.");
    describe_counter!(AUTO_GREEDY_STEPS, "Auto mode: greedy steps taken without asking the drafter.");
    describe_counter!(AUTO_DECLINED_TREES, "Auto mode: drafted trees of which nothing was verified.");
    describe_counter!(
        AUTO_OVERLAPPED_STEPS,
        "Auto mode: greedy steps taken while the drafter was drafting a tree."
    );
    describe_counter!(
        AUTO_STALE_TREES,
        "Auto mode: trees that arrived after the overlapped greedy steps had left them."
    );
    describe_counter!(AUTO_VERIFIED_NODES, "Auto mode: tree nodes verified.");
    describe_counter!(
        AUTO_LOOKUP_ROUNDS,
        "Auto mode: rounds that verified a prompt-lookup chain in place of a greedy step."
    );
    describe_counter!(AUTO_LOOKUP_ACCEPTED, "Auto mode: prompt-lookup tokens accepted.");
    describe_counter!(
        AUTO_GRAFTED_ACCEPTED,
        "Auto mode: prompt-lookup tokens accepted past the drafter's path in drafted rounds with a lookup grafted on."
    );
    describe_counter!(
        AUTO_KNOWN_INSTRUCTIONS,
        "Auto mode: requests that started from the policy of an earlier request of the same instruction."
    );
    describe_gauge!(
        AUTO_CALIBRATION_ERROR,
        "Auto mode: mean |predicted - committed| tokens per verified round, last auto request."
    );
    describe_histogram!(
        DRAFTER_ROUND_LATENCY,
        Unit::Seconds,
        "Drafter round trip: request sent to tree received."
    );
    describe_counter!(DRAFTER_BYTES, Unit::Bytes, "Serialized bytes sent to the drafter.");
    describe_gauge!(DRAFTER_CONNECTED, "1 while a compatible drafter is connected.");
    describe_counter!(
        DRAFTER_MISMATCHES,
        "Drafter pods seen that do not fit this target or the pool (left out, requests decode without them)."
    );
}

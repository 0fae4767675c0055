//! The short soak (about a minute): `bench_soak` drives both services with concurrent mixed
//! requests while the drafter is killed and restarted twice; every completed output must equal
//! greedy, no request may fail (refusals under overload and cancelled streams aside), and the
//! server must still serve greedy tokens afterwards. Latency and RSS figures are the benchmark's
//! to report, not asserted here.

use std::process::Command;

#[test]
fn a_short_soak_loses_and_corrupts_nothing() {
    let models = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models");
    let json = std::env::temp_dir().join(format!("glance-soak-{}.json", std::process::id()));
    let status = Command::new(glance_tests::process::binary("bench_soak"))
        .arg("--target")
        .arg(models.join("toy-target"))
        .arg("--head")
        .arg(models.join("toy-head"))
        .args(["--seconds", "45", "--clients", "4", "--prompts", "6", "--json"])
        .arg(&json)
        .status()
        .expect("bench_soak runs");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("report")).unwrap();
    println!("{report:#}");
    assert!(status.success(), "bench_soak failed: {report}");
    assert_eq!(report["failed"], 0);
    assert_eq!(report["wrong"], 0);
    assert_eq!(report["drafter_restarts"], 2);
    assert!(report["completed"].as_u64().unwrap() > 20, "{report}");
    assert!(report["cancelled"].as_u64().unwrap() > 0, "some streams were cancelled");
    assert_eq!(report["served_greedy_after"], true);
    let _ = std::fs::remove_file(json);
}

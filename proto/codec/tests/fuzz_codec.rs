//! Fuzzing the wire codec's decoder (property tests on stable Rust): whatever a peer sends as a
//! `TensorData`, decoding returns a tensor of exactly the stated shape or an error, never a panic.
//! `GLANCE_FUZZ_CASES` sets the number of cases (CI: the default; a long run: 1,000,000).

use glance_codec::{decode, encode};
use glance_proto::drafter::v1 as pb;
use proptest::prelude::*;
use tch::{Kind, Tensor};

fn cases(default: u32) -> u32 {
    std::env::var("GLANCE_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Dimensions as a peer might send them: mostly small, sometimes zero, sometimes absurd.
fn dimension() -> impl Strategy<Value = u64> {
    prop_oneof![
        6 => 0u64..6,
        1 => Just(0u64),
        1 => any::<u64>(),
        1 => prop_oneof![Just(u64::MAX), Just(1u64 << 63), Just((1u64 << 63) + 5), Just(1u64 << 62), Just(i64::MAX as u64)],
    ]
}

fn dtype() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop_oneof![Just("f32".to_string()), Just("bf16".to_string()), Just("f16".to_string())],
        1 => "[a-z0-9]{0,6}",
    ]
}

/// A tensor message whose byte count is right for its shape half of the time.
fn tensor_data() -> impl Strategy<Value = pb::TensorData> {
    (dtype(), prop::collection::vec(dimension(), 0..10), any::<bool>(), 0usize..300).prop_map(
        |(dtype, shape, matching, random_len)| {
            let element = if dtype == "f32" { 4 } else { 2 };
            let numel = shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
            let len = match numel.and_then(|n| n.checked_mul(element)) {
                Some(bytes) if matching && bytes <= 4096 => bytes as usize,
                _ => random_len,
            };
            pb::TensorData { dtype, shape, data: vec![7u8; len].into() }
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(20_000), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn decoding_any_tensor_message_never_panics(data in tensor_data()) {
        if let Ok(tensor) = decode(&data) {
            let shape: Vec<i64> = data.shape.iter().map(|&d| d as i64).collect();
            prop_assert_eq!(tensor.size(), shape);
            let element = if data.dtype == "f32" { 4 } else { 2 };
            prop_assert_eq!(tensor.numel() * element, data.data.len());
        }
    }

    #[test]
    fn what_is_encoded_decodes_to_the_same_values(rows in 0i64..6, cols in 0i64..6, seed in any::<i64>()) {
        tch::manual_seed(seed);
        let t = Tensor::randn([rows, cols], (Kind::Float, tch::Device::Cpu));
        let back = decode(&encode(&t, Kind::Float)).unwrap();
        prop_assert!(back.equal(&t));
    }
}

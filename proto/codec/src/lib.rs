//! glance-codec: the wire codec between the services — tensors as dtype name, shape and
//! little-endian row-major bytes, and the drafter protocol's messages to and from the shared types
//! of `glance-spec` (the tree, the handshake).

use glance_spec::session::{DrafterKind, Handshake};
use glance_spec::tree::{Reach, Tree};
use tch::{Kind, Tensor};

use glance_proto::drafter::v1 as pb;

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("unsupported tensor dtype {0:?} (f32, bf16, f16)")]
    Dtype(String),
    #[error("tensor of shape {shape:?} and dtype {dtype} needs {expected} bytes, got {got}")]
    Size { shape: Vec<u64>, dtype: String, expected: usize, got: usize },
    #[error("tensor shape {shape:?}: at most {MAX_RANK} dimensions whose product (zeros aside) fits in i64")]
    Shape { shape: Vec<u64> },
}

/// Most dimensions a tensor on the wire may have (the protocol sends matrices).
pub const MAX_RANK: usize = 8;

/// Whether libtorch can lay out a tensor of `shape`: its strides are products of dimensions and
/// are `i64`, also when a zero dimension makes the tensor empty (so the byte-count check alone
/// would let `[0, 2^62, 2^62]` through).
fn shape_fits(shape: &[u64]) -> bool {
    shape.len() <= MAX_RANK
        && shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d.max(1)))
            .is_some_and(|p| p <= i64::MAX as u64)
}

/// Wire name of a floating kind.
pub fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::BFloat16 => "bf16",
        Kind::Half => "f16",
        _ => "f32",
    }
}

/// The kind a wire name stands for, and its element size.
fn kind_of(name: &str) -> Option<(Kind, usize)> {
    match name {
        "f32" => Some((Kind::Float, 4)),
        "bf16" => Some((Kind::BFloat16, 2)),
        "f16" => Some((Kind::Half, 2)),
        _ => None,
    }
}

/// Serializes `tensor` as `kind` (bf16/f16 on the wire halve the bytes of f32 states). The round
/// path hands it host tensors (the verifier keeps its tap-state history on the host); a device
/// tensor is read back first, which is a host sync and counted as one.
pub fn encode(tensor: &Tensor, kind: Kind) -> pb::TensorData {
    let host = match tensor.device() {
        tch::Device::Cpu => tensor.shallow_clone(),
        _ => glance_device::read_back(tensor),
    };
    let cpu = host.to_kind(kind).contiguous();
    let numel = cpu.numel();
    let element = kind_of(kind_name(kind)).map(|(_, size)| size).unwrap_or(4);
    let mut data = vec![0u8; numel * element];
    cpu.copy_data_u8(&mut data, numel);
    pb::TensorData {
        dtype: kind_name(kind).to_string(),
        shape: cpu.size().iter().map(|&d| d as u64).collect(),
        data: data.into(),
    }
}

/// Deserializes into a CPU tensor, checking that the byte count matches dtype and shape (the
/// receiver uploads it to its device).
pub fn decode(data: &pb::TensorData) -> Result<Tensor, WireError> {
    let (kind, element) = kind_of(&data.dtype).ok_or_else(|| WireError::Dtype(data.dtype.clone()))?;
    if !shape_fits(&data.shape) {
        return Err(WireError::Shape { shape: data.shape.clone() });
    }
    let numel = data.shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d as usize));
    let expected = numel.and_then(|n| n.checked_mul(element));
    if expected != Some(data.data.len()) {
        return Err(WireError::Size {
            shape: data.shape.clone(),
            dtype: data.dtype.clone(),
            expected: expected.unwrap_or(usize::MAX),
            got: data.data.len(),
        });
    }
    let shape: Vec<i64> = data.shape.iter().map(|&d| d as i64).collect();
    Tensor::f_from_data_size(&data.data, &shape, kind)
        .map_err(|_| WireError::Shape { shape: data.shape.clone() })
}

/// A drafted tree as the drafter answers a round (`draft_ms`: its time on the round).
pub fn tree_response(tree: Tree, draft_ms: f64) -> pb::DraftResponse {
    pb::DraftResponse {
        tokens: tree.tokens,
        parents: tree.parents,
        depths: tree.depths,
        log_probs: tree.log_probs.iter().map(|&lp| lp as f32).collect(),
        draft_ms,
    }
}

/// The tree of a drafter's answer, not yet validated.
pub fn response_tree(response: pb::DraftResponse) -> Tree {
    Tree {
        tokens: response.tokens,
        parents: response.parents,
        depths: response.depths,
        log_probs: response.log_probs.iter().map(|&lp| f64::from(lp)).collect(),
    }
}

/// A round request's reach ([`Reach`]); a `max_depth` of 0 is no limit but the block's.
pub fn round_reach(round: &pb::RoundRequest) -> Reach {
    let max_depth = if round.max_depth == 0 { usize::MAX } else { round.max_depth as usize };
    Reach { max_depth, ends: round.end_tokens.clone() }
}

/// A reach's depth as a round request carries it (beyond the wire's range: no limit, 0).
pub fn wire_max_depth(max_depth: usize) -> u32 {
    u32::try_from(max_depth).unwrap_or(0)
}

/// The handshake as the drafter answers it.
pub fn handshake_response(h: Handshake) -> pb::HandshakeResponse {
    let kind = match h.kind {
        DrafterKind::BlockHead => pb::DrafterKind::BlockHead,
        DrafterKind::PromptLookup => pb::DrafterKind::PromptLookup,
        DrafterKind::TestOracle => pb::DrafterKind::TestOracle,
        DrafterKind::TestGarbage => pb::DrafterKind::TestGarbage,
        DrafterKind::Eagle3 => pb::DrafterKind::Eagle3,
    };
    pb::HandshakeResponse {
        kind: kind as i32,
        block_size: h.block_size as u32,
        mask_token_id: h.mask_token_id,
        tap_layers: h.tap_layers.iter().map(|&l| l as u32).collect(),
        hidden_size: h.hidden_size as u32,
        vocab_size: h.vocab_size as u32,
        dtype: kind_name(h.dtype).to_string(),
        target_fingerprint: h.target_fingerprint,
        max_tree_nodes: h.max_tree_nodes as u32,
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // tests build and read host tensors freely
mod tests {
    use super::*;
    use tch::Device;

    #[test]
    fn round_trips_and_checks_sizes() {
        let t = Tensor::arange(12, (Kind::Float, Device::Cpu)).view([3, 4]) / 3.0;
        for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
            let wire = encode(&t, kind);
            let back = decode(&wire).unwrap();
            assert_eq!(back.size(), vec![3, 4]);
            let diff = (back.to_kind(Kind::Float) - &t).abs().max().double_value(&[]);
            assert!(diff < 0.02, "{kind:?}: {diff}");
        }
        let mut bad = encode(&t, Kind::Float);
        bad.data.truncate(bad.data.len() - 1);
        assert!(decode(&bad).is_err());
        bad.dtype = "int8".into();
        assert!(decode(&bad).is_err());
    }

    #[test]
    fn shapes_no_tensor_can_have_are_refused() {
        let empty = |shape: Vec<u64>| pb::TensorData { dtype: "f32".into(), shape, data: Vec::new().into() };
        // A zero dimension makes the byte count 0 whatever the others are.
        for shape in
            [vec![0, (1 << 63) + 5], vec![0, u64::MAX], vec![1; MAX_RANK + 1], vec![u64::MAX, u64::MAX]]
        {
            assert!(decode(&empty(shape.clone())).is_err(), "{shape:?}");
        }
        // Empty tensors of sane shapes are fine.
        assert_eq!(decode(&empty(vec![0, 4])).unwrap().size(), [0, 4]);
        assert_eq!(decode(&empty(vec![])).map(|t| t.numel()).ok(), None, "a scalar has 4 bytes");
    }

    #[test]
    fn trees_cross_the_wire_unchanged() {
        let mut tree = Tree::default();
        tree.push(7, -1, -0.5);
        tree.push(9, 0, -1.25);
        assert_eq!(response_tree(tree_response(tree.clone(), 1.0)), tree);
    }

    #[test]
    fn a_reach_crosses_the_wire_and_an_old_verifier_sends_none() {
        let round = |max_depth: usize, end_tokens: Vec<u32>| pb::RoundRequest {
            max_depth: wire_max_depth(max_depth),
            end_tokens,
            ..Default::default()
        };
        assert_eq!(round_reach(&round(5, vec![2, 7])), Reach { max_depth: 5, ends: vec![2, 7] });
        assert_eq!(round_reach(&round(usize::MAX, vec![])), Reach::unbounded());
        assert_eq!(round_reach(&pb::RoundRequest::default()), Reach::unbounded());
    }
}

//! What a target pass reads back per row of its logits, in ONE host copy: the row's choice (the
//! argmax, or the draw: see [`crate::sampling`]) and, when asked, the target's entropy there (the
//! auto policy's predictor) and the chosen token's log-probability with the most likely
//! alternatives. The greedy step, the autoregressive decoder and every verify pass read through
//! [`read_rows`], so a token's reported log-probability is the same computation whichever pass
//! chose it (equal up to the float rounding between a verify pass and a step).
//!
//! A log-probability is under the distribution the token is chosen from: the softmax of the raw
//! logits when decoding greedily, the processed distribution (temperature, then top-k, top-p,
//! min-p) when sampling, as transformers' `compute_transition_scores(normalize_logits=True)` gives
//! it from `generate`'s scores. A token sampling removed has probability 0: it is never chosen and
//! never listed as an alternative.

use tch::{Kind, Tensor};

use crate::sampling::{draw, warped_scores, Sampling};

/// Most alternatives a token's log-probability may list (the API's limit, as OpenAI's).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// What to read back per row besides its choice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reads {
    /// The entropy (nats) of the raw logits' softmax.
    pub entropy: bool,
    /// The chosen token's log-probability, with this many most likely alternatives.
    pub logprobs: Option<usize>,
}

/// A token's log-probability and the most likely tokens of the same distribution, best first.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub logprob: f32,
    /// (token id, log-probability), at most the count asked for, only tokens of nonzero probability.
    pub top: Vec<(i64, f32)>,
}

/// Every row's readings.
#[derive(Clone, Debug, Default)]
pub struct RowsRead {
    pub choices: Vec<i64>,
    /// Empty unless asked for.
    pub entropies: Vec<f32>,
    /// Of each row's choice; empty unless asked for.
    pub logprobs: Vec<TokenLogprob>,
}

/// Reads every row of `logits` (rows, vocab): its choice under `sampling` (the draw with
/// `numerators`' uniforms when sampling) and what `reads` asks for, packed into one f32 tensor and
/// read back at once (one host sync). Token ids are exact in f32 below 2^24.
pub fn read_rows(
    logits: &Tensor,
    sampling: &Sampling,
    numerators: Option<&Tensor>,
    reads: Reads,
) -> RowsRead {
    let rows = logits.size()[0] as usize;
    // The processed scores, computed once for both the draw and the log-probabilities.
    let scores = (!sampling.is_greedy()).then(|| warped_scores(logits, sampling));
    let chosen = match (&scores, numerators) {
        (Some(scores), Some(numerators)) => draw(scores, numerators),
        _ => logits.argmax(-1, false),
    };
    let mut packed = vec![chosen.to_kind(Kind::Float)];
    if reads.entropy {
        packed.push(entropies_nats(logits));
    }
    let top = reads.logprobs.map(|top| top.min(logits.size()[1] as usize));
    if let Some(top) = top {
        let source = scores.as_ref().unwrap_or(logits);
        let log_probs = source.log_softmax(-1, Kind::Float);
        packed.push(log_probs.gather(-1, &chosen.unsqueeze(-1), false).view([-1]));
        if top > 0 {
            let (values, ids) = log_probs.topk(top as i64, -1, true, true);
            packed.push(values.reshape([-1]));
            packed.push(ids.to_kind(Kind::Float).reshape([-1]));
        }
    }
    let packed = if packed.len() == 1 { packed.remove(0) } else { Tensor::cat(&packed, 0) };
    let host = Vec::<f32>::try_from(crate::read_back(&packed)).expect("a 1-D f32 tensor");
    unpack(&host, rows, reads.entropy, top)
}

/// Splits the packed read-back: choices, entropies, chosen log-probabilities, top values, top ids.
fn unpack(host: &[f32], rows: usize, entropy: bool, top: Option<usize>) -> RowsRead {
    let mut rest = host;
    let mut take = |count: usize| {
        let (head, tail) = rest.split_at(count);
        rest = tail;
        head
    };
    let choices = take(rows).iter().map(|&c| c as i64).collect();
    let entropies = if entropy { take(rows).to_vec() } else { Vec::new() };
    let logprobs = match top {
        None => Vec::new(),
        Some(top) => {
            let chosen = take(rows).to_vec();
            let values = take(rows * top).to_vec();
            let ids = take(rows * top);
            (0..rows)
                .map(|r| {
                    let alternatives = (r * top..(r + 1) * top)
                        .filter(|&i| values[i].is_finite())
                        .map(|i| (ids[i] as i64, values[i]))
                        .collect();
                    TokenLogprob { logprob: chosen[r], top: alternatives }
                })
                .collect()
        }
    };
    RowsRead { choices, entropies, logprobs }
}

/// The log-probabilities tokens are chosen with, (rows, vocab) f32: of the raw logits when greedy,
/// of the processed scores when sampling (-inf for a removed token).
pub fn log_probs(logits: &Tensor, sampling: &Sampling) -> Tensor {
    if sampling.is_greedy() {
        logits.log_softmax(-1, Kind::Float)
    } else {
        warped_scores(logits, sampling).log_softmax(-1, Kind::Float)
    }
}

/// Shannon entropy in nats of softmax over the last dimension of (rows, vocab) logits, in f32.
pub fn entropies_nats(logits: &Tensor) -> Tensor {
    let log_p = logits.log_softmax(-1, Kind::Float);
    -(log_p.exp() * &log_p).sum_dim_intlist(-1, false, Kind::Float)
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // tests build and read host tensors freely
mod tests {
    use super::*;

    fn logits() -> Tensor {
        Tensor::from_slice(&[2.0f32, 1.0, 0.5, 0.0, -1.0, 3.0, 0.1, 1.0, 4.0, -0.5, 0.3, 0.2]).view([2, 6])
    }

    #[test]
    fn greedy_rows_read_the_argmax_and_the_raw_log_softmax() {
        let reads = Reads { entropy: true, logprobs: Some(3) };
        let read = read_rows(&logits(), &Sampling::GREEDY, None, reads);
        assert_eq!(read.choices, [5, 2]);
        let expected = logits().log_softmax(-1, Kind::Float);
        for (row, &token) in read.choices.iter().enumerate() {
            let lp = &read.logprobs[row];
            let want = expected.double_value(&[row as i64, token]) as f32;
            assert!((lp.logprob - want).abs() < 1e-6);
            assert_eq!(lp.top.len(), 3);
            assert_eq!(lp.top[0], (token, lp.logprob), "the argmax leads its alternatives");
            assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
        }
        assert_eq!(read.top_ids(1), [2, 1, 4]);
        let entropy = entropies_nats(&logits());
        assert!((read.entropies[1] - entropy.double_value(&[1]) as f32).abs() < 1e-6);
    }

    #[test]
    fn sampled_rows_read_the_processed_distribution_and_no_removed_token() {
        let sampling = Sampling { temperature: 0.5, top_k: 2, seed: 3, ..Sampling::GREEDY };
        let numerators = Tensor::from_slice(&[0i64, (1 << 24) - 1]);
        let reads = Reads { entropy: false, logprobs: Some(5) };
        let read = read_rows(&logits(), &sampling, Some(&numerators), reads);
        assert!(read.entropies.is_empty());
        // Row 0 keeps tokens 5 and 0 (scores 6 and 4): u = 0 draws the first with mass; row 1
        // keeps 2 and 1, and u = 1 - 2^-24 draws the last with mass.
        assert_eq!(read.choices, [0, 2]);
        let p0 = 1.0 / (1.0 + (2.0f32).exp());
        assert!((read.logprobs[0].logprob - p0.ln()).abs() < 1e-6);
        assert_eq!(read.top_ids(0), [5, 0], "only the two tokens top-k keeps");
        assert_eq!(read.logprobs[1].top.len(), 2);
    }

    #[test]
    fn nothing_asked_reads_only_the_choices() {
        let read = read_rows(&logits(), &Sampling::GREEDY, None, Reads::default());
        assert_eq!(read.choices, [5, 2]);
        assert!(read.entropies.is_empty() && read.logprobs.is_empty());
        let none =
            read_rows(&logits(), &Sampling::GREEDY, None, Reads { logprobs: Some(0), ..Reads::default() });
        assert!(none.logprobs.iter().all(|lp| lp.top.is_empty()) && none.logprobs.len() == 2);
    }

    impl RowsRead {
        fn top_ids(&self, row: usize) -> Vec<i64> {
            self.logprobs[row].top.iter().map(|&(id, _)| id).collect()
        }
    }
}

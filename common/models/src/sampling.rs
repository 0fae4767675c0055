//! Sampling from the target: the processed distribution (temperature, then top-k, top-p and
//! min-p, in the order transformers' `generate` applies its warpers, with the same tensor
//! operations) and the draw from it.
//!
//! The draw is by inverse CDF with one uniform per *generated token index*, taken from a
//! counter-based generator keyed by the request's seed: the token at index `i` is always drawn
//! with `uniform(seed, i)`, whichever pass computes its distribution. A verify pass draws, at a
//! node of depth `d` under a root that draws index `i`, with `uniform(seed, i + d)`. Walking the
//! tree from the root, moving to the child that holds the drawn token and stopping where none
//! does, then commits exactly the tokens plain sampling with the same seed would: each committed
//! token is drawn from the target's distribution given the tokens before it, with that index's
//! uniform, and the tree only decides how many of them one pass confirms. So speculative
//! sampling is lossless for any tree the drafter sends (it never sees the uniforms), and the same
//! seed gives the same tokens in every mode up to float rounding between a verify pass and a step.

use tch::{Kind, Tensor};

/// How the next token is chosen from the target's logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// Divides the logits; 0 means greedy (argmax, every other field ignored).
    pub temperature: f64,
    /// Keep the `top_k` highest scores; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of highest-probability tokens whose mass reaches `top_p`; 1 keeps all.
    pub top_p: f64,
    /// Drop tokens below `min_p` times the top token's probability; 0 keeps all.
    pub min_p: f64,
    /// Keys the uniforms of the draws.
    pub seed: u64,
}

impl Sampling {
    /// Greedy decoding: the argmax of the raw logits, bit-identical to decoding without sampling.
    pub const GREEDY: Sampling = Sampling { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 0 };

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// The numerator (of 2^24) of the uniform that draws generated token `index`.
    pub fn uniform_numerator(&self, index: u64) -> i64 {
        (splitmix64(self.seed ^ splitmix64(index)) >> 40) as i64
    }
}

/// The draws of one pass: the request's sampling and the generated index its first row draws (a
/// tree node of depth `d` draws `index + d`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Draw {
    pub sampling: Sampling,
    pub index: u64,
}

impl Draw {
    pub const GREEDY: Draw = Draw { sampling: Sampling::GREEDY, index: 0 };

    /// The uniforms' numerators of rows at these depths; none when greedy.
    pub fn numerators(&self, depths: impl IntoIterator<Item = usize>) -> Vec<i64> {
        if self.sampling.is_greedy() {
            return Vec::new();
        }
        depths.into_iter().map(|d| self.sampling.uniform_numerator(self.index + d as u64)).collect()
    }

    /// The uniform of a single row drawing `index`, uploaded to `device`; none when greedy.
    pub fn upload_single_row(&self, device: tch::Device) -> Option<Tensor> {
        let numerators = self.numerators([0]);
        (!numerators.is_empty()).then(|| crate::upload(&numerators, device))
    }
}

/// The logits as transformers' sampling warpers leave them, (rows, vocab) f32: divided by the
/// temperature, then every token that top-k, top-p or min-p removes set to -inf.
/// (`TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`, `MinPLogitsWarper`, each
/// with `min_tokens_to_keep = 1`.)
pub fn warped_scores(logits: &Tensor, sampling: &Sampling) -> Tensor {
    // (Never in place: `to_kind` of f32 logits is the caller's tensor itself.)
    let float = logits.to_kind(Kind::Float);
    let mut scores = if sampling.temperature != 1.0 { float / sampling.temperature } else { float };
    let vocab = scores.size().last().copied().unwrap_or(0);
    if sampling.top_k > 0 {
        let k = (sampling.top_k as i64).min(vocab);
        let kth = scores.topk(k, -1, true, true).0.narrow(-1, k - 1, 1);
        scores = scores.masked_fill(&scores.lt_tensor(&kth), f64::NEG_INFINITY);
    }
    if sampling.top_p < 1.0 {
        scores = top_p_filtered(&scores, sampling.top_p, vocab);
    }
    if sampling.min_p > 0.0 {
        scores = min_p_filtered(&scores, sampling.min_p);
    }
    scores
}

/// Drops the low tail whose probability mass stays within `1 - top_p` (ascending sort, the
/// highest token always kept).
fn top_p_filtered(scores: &Tensor, top_p: f64, vocab: i64) -> Tensor {
    let (sorted, order) = scores.sort(-1, false);
    let cumulative = sorted.softmax(-1, Kind::Float).cumsum(-1, Kind::Float);
    let remove_sorted = cumulative.le(1.0 - top_p);
    let _ = remove_sorted.narrow(-1, vocab - 1, 1).fill_(0);
    let remove = remove_sorted.scatter(-1, &order, &remove_sorted);
    scores.masked_fill(&remove, f64::NEG_INFINITY)
}

/// Drops tokens less likely than `min_p` times the most likely one (which is always kept).
fn min_p_filtered(scores: &Tensor, min_p: f64) -> Tensor {
    let probs = scores.softmax(-1, Kind::Float);
    let threshold = probs.amax([-1].as_slice(), true) * min_p;
    let remove = probs.lt_tensor(&threshold);
    let top = probs.topk(1, -1, true, true).1;
    let remove = remove.scatter_value(-1, &top, 0);
    scores.masked_fill(&remove, f64::NEG_INFINITY)
}

/// Each row's next token, (rows) int64 on the logits' device: the argmax when greedy, else a
/// draw from the processed distribution by inverse CDF with the uniform `numerators[row] / 2^24`
/// (`numerators`: (rows) int64, on the logits' device).
pub fn choose(logits: &Tensor, sampling: &Sampling, numerators: Option<&Tensor>) -> Tensor {
    let (Some(numerators), false) = (numerators, sampling.is_greedy()) else {
        return logits.argmax(-1, false);
    };
    draw(&warped_scores(logits, sampling), numerators)
}

/// Each row's draw from processed `scores` (rows, vocab), as [`choose`] makes it.
pub fn draw(scores: &Tensor, numerators: &Tensor) -> Tensor {
    let probs = scores.softmax(-1, Kind::Float);
    let cdf = probs.cumsum(-1, Kind::Float);
    let vocab = cdf.size().last().copied().unwrap_or(1);
    let total = cdf.narrow(-1, vocab - 1, 1);
    let uniforms = numerators.to_kind(Kind::Float).unsqueeze(-1) / f64::from(1u32 << 24);
    // The first token whose cumulative mass exceeds u·total: the count of those that do not.
    // A removed token adds no mass, so it is never the first to exceed it. When u·total rounds
    // up to the total no token exceeds it: the last token with mass (the first reaching the
    // total) is drawn, never a removed token after it.
    let below = cdf.le_tensor(&(uniforms * &total)).sum_dim_intlist(-1, false, Kind::Int64);
    let last_with_mass = cdf.lt_tensor(&total).sum_dim_intlist(-1, false, Kind::Int64);
    below.minimum(&last_with_mass)
}

/// SplitMix64's finalizer: a bijection of u64 whose outputs pass BigCrush as a counter-based
/// generator.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // tests build and read host tensors freely
mod tests {
    use super::*;

    fn logits() -> Tensor {
        Tensor::from_slice(&[2.0f32, 1.0, 0.5, 0.0, -1.0, 3.0]).view([1, 6])
    }

    fn sampling(temperature: f64) -> Sampling {
        Sampling { temperature, seed: 7, ..Sampling::GREEDY }
    }

    #[test]
    fn greedy_is_the_argmax() {
        let chosen = choose(&logits(), &Sampling::GREEDY, None);
        assert_eq!(chosen.int64_value(&[0]), 5);
    }

    #[test]
    fn filters_keep_what_transformers_keeps() {
        let kept = |s: Sampling| -> Vec<bool> {
            let scores = warped_scores(&logits(), &s).view([-1]);
            Vec::<f32>::try_from(scores).unwrap().iter().map(|v| v.is_finite()).collect()
        };
        assert_eq!(kept(Sampling { top_k: 2, ..sampling(1.0) }), [true, false, false, false, false, true]);
        // p = softmax: 3.0 -> 0.61, 2.0 -> 0.22, 1.0 -> 0.08: 0.83 < 0.9 <= 0.91
        assert_eq!(kept(Sampling { top_p: 0.9, ..sampling(1.0) }), [true, true, false, false, false, true]);
        // min_p 0.3 of the top's 0.61: only 0.22 and above stay
        assert_eq!(kept(Sampling { min_p: 0.3, ..sampling(1.0) }), [true, false, false, false, false, true]);
        assert_eq!(
            kept(Sampling { top_k: 1, top_p: 0.01, ..sampling(1.0) }).iter().filter(|&&k| k).count(),
            1
        );
    }

    #[test]
    fn draws_follow_the_uniforms() {
        let s = sampling(1.0);
        // u near 0 picks the first token with mass, u near 1 the last.
        let low = choose(&logits(), &s, Some(&Tensor::from_slice(&[0i64])));
        let high = choose(&logits(), &s, Some(&Tensor::from_slice(&[(1i64 << 24) - 1])));
        assert_eq!((low.int64_value(&[0]), high.int64_value(&[0])), (0, 5));
        // A removed token is never drawn, whatever the uniform.
        let top2 = Sampling { top_k: 2, ..s };
        for numerator in (0..1i64 << 24).step_by(1 << 18) {
            let token = choose(&logits(), &top2, Some(&Tensor::from_slice(&[numerator]))).int64_value(&[0]);
            assert!(token == 0 || token == 5, "{numerator}: {token}");
        }
        // Nor when u·total reaches the total (here u = 1): the last token with mass is drawn, not
        // the removed ones after it.
        let top1 = Sampling { top_k: 1, ..s };
        let first_is_top = Tensor::from_slice(&[3.0f32, 1.0, 0.0, 2.0]).view([1, 4]);
        let token = choose(&first_is_top, &top1, Some(&Tensor::from_slice(&[1i64 << 24])));
        assert_eq!(token.int64_value(&[0]), 0);
    }

    #[test]
    fn uniforms_depend_on_seed_and_index_only() {
        let a = Sampling { seed: 1, ..Sampling::GREEDY };
        let b = Sampling { seed: 2, ..Sampling::GREEDY };
        assert_eq!(a.uniform_numerator(5), a.uniform_numerator(5));
        assert_ne!(a.uniform_numerator(5), a.uniform_numerator(6));
        assert_ne!(a.uniform_numerator(5), b.uniform_numerator(5));
        assert!((0..1000).all(|i| (0..1 << 24).contains(&a.uniform_numerator(i))));
    }
}

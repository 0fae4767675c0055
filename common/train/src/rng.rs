//! Randomness and hashing that give the same numbers on every machine and every Rust release (the
//! toy world's samples, fresh weights, the training row order, the test drafters' trees):
//! SplitMix64 (a fixed, published algorithm) instead of `rand`'s generators, whose streams may
//! change between versions, and integer-only range reduction (floats only where a caller asks for them).

/// SplitMix64's finalizer: a bijective 64-bit mix with good avalanche.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Folds several words into one seed; order matters, so `(split, task, index)` tuples that differ
/// in any position give unrelated seeds.
pub fn combine(parts: &[u64]) -> u64 {
    parts.iter().fold(0x6a09_e667_f3bc_c908, |acc, &part| mix64(acc ^ mix64(part)))
}

/// 64-bit FNV-1a over bytes.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

/// FNV-1a over bytes, finalized with [`mix64`] so that the low bits are usable for bucketing.
pub fn hash_bytes(bytes: &[u8]) -> u64 {
    mix64(fnv1a(bytes))
}

/// The SplitMix64 generator.
#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix64(self.state)
    }

    /// Uniform-enough integer in `0..n` (multiply-high reduction; the bias is below 2^-32 for
    /// the small `n` used here). `n` must be positive.
    pub fn below(&mut self, n: usize) -> usize {
        assert!(n > 0, "Rng::below(0)");
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// Integer in `lo..=hi`.
    pub fn range(&mut self, lo: u32, hi: u32) -> u32 {
        assert!(lo <= hi, "Rng::range({lo}, {hi})");
        lo + self.below((hi - lo + 1) as usize) as u32
    }

    /// True with probability `percent` / 100.
    pub fn percent(&mut self, percent: u32) -> bool {
        self.below(100) < percent as usize
    }

    /// Uniform in (0, 1]: never 0, so its logarithm is finite.
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// A standard normal draw (Box–Muller, one of the pair; simplicity over speed).
    pub fn standard_normal(&mut self) -> f64 {
        let (u1, u2) = (self.uniform(), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    /// Fisher-Yates.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }

    /// `k` distinct indices of `0..n`, in random order.
    pub fn distinct(&mut self, n: usize, k: usize) -> Vec<usize> {
        assert!(k <= n, "Rng::distinct({n}, {k})");
        let mut all: Vec<usize> = (0..n).collect();
        self.shuffle(&mut all);
        all.truncate(k);
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pins the stream: if this changes, every generated sample changes.
    #[test]
    fn splitmix_matches_the_published_sequence() {
        let mut rng = Rng::new(1234567);
        let first: Vec<u64> = (0..3).map(|_| rng.next_u64()).collect();
        assert_eq!(first, [6457827717110365317, 3203168211198807973, 9817491932198370423]);
    }

    #[test]
    fn below_stays_in_range() {
        let mut rng = Rng::new(7);
        assert!((0..10_000).all(|_| rng.below(7) < 7));
    }

    #[test]
    fn normal_draws_are_deterministic_and_standard() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        let xs: Vec<f64> = (0..20000).map(|_| a.standard_normal()).collect();
        let ys: Vec<f64> = (0..20000).map(|_| b.standard_normal()).collect();
        assert_eq!(xs, ys);
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / xs.len() as f64;
        assert!(mean.abs() < 0.03, "mean {mean}");
        assert!((var - 1.0).abs() < 0.05, "variance {var}");
        assert_ne!(fnv1a(b"fc.weight"), fnv1a(b"norm.weight"));
    }
}

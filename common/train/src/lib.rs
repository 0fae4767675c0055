//! glance-train: the training tools shared by the toy target's trainer and `drafter-svc train` —
//! AdamW on named parameters (fp32 moments), the cosine schedule with linear warm-up, global-norm
//! gradient clipping, the token cross-entropy, deterministic randomness ([`rng`]) and checkpoint
//! writing ([`save`]).

pub mod rng;
pub mod save;

use tch::{Kind, Tensor};

/// AdamW (decoupled weight decay), as torch.optim.AdamW computes it.
pub struct AdamW {
    params: Vec<Tensor>,
    first: Vec<Tensor>,
    second: Vec<Tensor>,
    step: i64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl AdamW {
    pub fn new(params: Vec<Tensor>, weight_decay: f64) -> Self {
        let zeros = |p: &Tensor| Tensor::zeros_like(p).to_kind(Kind::Float);
        let first = params.iter().map(zeros).collect();
        let second = params.iter().map(zeros).collect();
        Self { params, first, second, step: 0, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay }
    }

    /// One update with learning rate `lr` from the accumulated gradients, then zeroes them.
    pub fn step(&mut self, lr: f64) {
        let _no_grad = tch::no_grad_guard();
        self.step += 1;
        let correction1 = 1.0 - self.beta1.powi(self.step as i32);
        let correction2 = 1.0 - self.beta2.powi(self.step as i32);
        for ((param, m), v) in self.params.iter_mut().zip(&mut self.first).zip(&mut self.second) {
            let grad = param.grad();
            if !grad.defined() {
                continue;
            }
            let grad = grad.to_kind(Kind::Float);
            let _ = m.g_mul_scalar_(self.beta1).g_add_(&(&grad * (1.0 - self.beta1)));
            let _ = v.g_mul_scalar_(self.beta2).g_add_(&(grad.square() * (1.0 - self.beta2)));
            let denom = (&*v / correction2).sqrt() + self.eps;
            let update = (&*m / correction1) / denom;
            let decayed = param.to_kind(Kind::Float) * (1.0 - lr * self.weight_decay) - update * lr;
            param.copy_(&decayed.to_kind(param.kind()));
        }
        self.zero_grad();
    }

    pub fn zero_grad(&mut self) {
        for param in &mut self.params {
            let mut grad = param.grad();
            if grad.defined() {
                let _ = grad.zero_();
            }
        }
    }

    /// Scales all gradients so their global L2 norm is at most `max_norm`; returns the norm before.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> f64 {
        let _no_grad = tch::no_grad_guard();
        let grads: Vec<Tensor> = self.params.iter().map(|p| p.grad()).filter(|g| g.defined()).collect();
        // One read of the total (not one per parameter: on CUDA each read is a device sync).
        let squares: Vec<Tensor> =
            grads.iter().map(|g| g.to_kind(Kind::Double).square().sum(Kind::Double)).collect();
        let total = if squares.is_empty() {
            0.0
        } else {
            Tensor::stack(&squares, 0).sum(Kind::Double).sqrt().double_value(&[])
        };
        if total > max_norm && total.is_finite() {
            let scale = max_norm / (total + 1e-6);
            for mut g in grads {
                let _ = g.g_mul_scalar_(scale);
            }
        }
        total
    }

    pub fn steps_taken(&self) -> i64 {
        self.step
    }

    /// The moments, in parameter order (for resumable checkpoints).
    pub fn moments(&self) -> (&[Tensor], &[Tensor]) {
        (&self.first, &self.second)
    }

    /// Restores the moments and step count saved by a checkpoint.
    pub fn restore(&mut self, step: i64, first: Vec<Tensor>, second: Vec<Tensor>) {
        self.step = step;
        self.first = first;
        self.second = second;
    }
}

/// Learning rate at `step` of `total`: linear warm-up over `warmup` steps to `peak`, then cosine
/// decay to `peak · floor`.
pub fn cosine_lr(step: usize, total: usize, warmup: usize, peak: f64, floor: f64) -> f64 {
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let progress = (step - warmup) as f64 / (total.saturating_sub(warmup)).max(1) as f64;
    let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos());
    peak * (floor + (1.0 - floor) * cosine)
}

/// Mean (or weighted mean) token cross-entropy: `logits` (n, V), `labels` (n,) int64; `weights`
/// (n,) f32 or `None` for equal weights.
pub fn cross_entropy(logits: &Tensor, labels: &Tensor, weights: Option<&Tensor>) -> Tensor {
    let picked = token_cross_entropy(logits, labels);
    match weights {
        Some(w) => (picked * w).sum(Kind::Float) / w.sum(Kind::Float).clamp_min(1e-9),
        None => picked.mean(Kind::Float),
    }
}

/// The cross-entropy of each row: `logits` `[n, vocab]`, `labels` `[n]` → `[n]` (f32).
pub fn token_cross_entropy(logits: &Tensor, labels: &Tensor) -> Tensor {
    let log_probs = logits.to_kind(Kind::Float).log_softmax(-1, Kind::Float);
    log_probs.gather(1, &labels.unsqueeze(1), false).squeeze_dim(1).neg()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adamw_minimizes_a_quadratic() {
        let target = Tensor::from_slice(&[1.0f32, -2.0, 3.0]);
        let param = Tensor::zeros([3], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        let mut opt = AdamW::new(vec![param.shallow_clone()], 0.0);
        let loss_at = |p: &Tensor| (p - &target).square().sum(Kind::Float);
        let before = loss_at(&param).double_value(&[]);
        for _ in 0..300 {
            loss_at(&param).backward();
            opt.step(0.05);
        }
        let after = tch::no_grad(|| loss_at(&param).double_value(&[]));
        assert!(after < before * 1e-3, "{before} -> {after}");
    }

    #[test]
    fn schedule_warms_up_then_decays() {
        assert!((cosine_lr(0, 100, 10, 1.0, 0.1) - 0.1).abs() < 1e-9);
        assert!((cosine_lr(9, 100, 10, 1.0, 0.1) - 1.0).abs() < 1e-9);
        assert!((cosine_lr(100, 100, 10, 1.0, 0.1) - 0.1).abs() < 1e-9);
    }

    #[test]
    fn weighted_cross_entropy_matches_the_plain_mean_for_equal_weights() {
        let logits = Tensor::from_slice(&[2.0f32, 0.0, 0.0, 1.0, 3.0, 0.5]).view([2, 3]);
        let labels = Tensor::from_slice(&[0i64, 1]);
        let plain = cross_entropy(&logits, &labels, None).double_value(&[]);
        let weighted =
            cross_entropy(&logits, &labels, Some(&Tensor::ones([2], (Kind::Float, tch::Device::Cpu))));
        assert!((plain - weighted.double_value(&[])).abs() < 1e-6);
    }
}

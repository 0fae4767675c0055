//! The entropy ("draftability") law (glance.md §7): per speculative round, the target's
//! next-token entropy H at the root (nats) and the number of accepted draft tokens a. The model is
//! logit p = b0 − b1·H (a per-token match probability along the block), with two expected-length
//! forms: the capped geometric mean min(p/(1−p), L) that the reference code fits, and the
//! finite-horizon sum p(1 − p^L)/(1 − p) the paper states. Fitted by least squares over individual
//! rounds; reported with the decile curve and Spearman's rank correlation.

/// Which expected-length form to fit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    /// min(p / (1 − p), L)
    CappedGeometric,
    /// p (1 − p^L) / (1 − p)
    FiniteHorizon,
}

/// One round: root entropy (nats) and accepted draft tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Round {
    pub entropy: f64,
    pub accepted: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Fit {
    pub form: Form,
    pub b0: f64,
    pub b1: f64,
    /// Share of the rounds' variance the fit explains.
    pub r2_rounds: f64,
    /// Share of the decile means' variance the fit explains.
    pub r2_deciles: f64,
}

/// Mean entropy, mean accepted and count of one entropy decile.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Decile {
    pub entropy: f64,
    pub accepted: f64,
    pub rounds: usize,
}

/// Per-token match probability at entropy `h`, clipped as the reference clips it.
pub fn match_probability(b0: f64, b1: f64, h: f64) -> f64 {
    let z = (b0 - b1 * h).clamp(-60.0, 60.0);
    (1.0 / (1.0 + (-z).exp())).clamp(1e-6, 1.0 - 1e-9)
}

/// Expected accepted length at entropy `h` with `horizon` = L draft offsets.
pub fn expected_accepted(form: Form, b0: f64, b1: f64, h: f64, horizon: usize) -> f64 {
    let p = match_probability(b0, b1, h);
    match form {
        Form::CappedGeometric => (p / (1.0 - p)).min(horizon as f64),
        Form::FiniteHorizon => p * (1.0 - p.powi(horizon as i32)) / (1.0 - p),
    }
}

fn residual_sum(form: Form, b: [f64; 2], rounds: &[Round], horizon: usize) -> f64 {
    rounds
        .iter()
        .map(|r| (expected_accepted(form, b[0], b[1], r.entropy, horizon) - r.accepted).powi(2))
        .sum()
}

/// Least-squares fit (Levenberg–Marquardt on the two parameters, numeric Jacobian) from the
/// reference's start point; None with fewer than 30 rounds or no variance in accepted lengths.
pub fn fit(form: Form, rounds: &[Round], horizon: usize) -> Option<Fit> {
    let n = rounds.len();
    let mean_a = rounds.iter().map(|r| r.accepted).sum::<f64>() / n.max(1) as f64;
    if n < 30 || rounds.iter().all(|r| (r.accepted - mean_a).abs() < 1e-12) {
        return None;
    }
    let m = mean_a.max(0.05);
    let mut b = [(m / (1.0 + m) / (1.0 - m / (1.0 + m))).ln(), 1.0];
    let mut cost = residual_sum(form, b, rounds, horizon);
    let mut damping = 1e-3;
    for _ in 0..500 {
        let (jtj, jtr) = normal_equations(form, b, rounds, horizon);
        let a = [[jtj[0][0] * (1.0 + damping), jtj[0][1]], [jtj[1][0], jtj[1][1] * (1.0 + damping)]];
        let det = a[0][0] * a[1][1] - a[0][1] * a[1][0];
        if det.abs() < 1e-300 {
            break;
        }
        let step = [(a[1][1] * jtr[0] - a[0][1] * jtr[1]) / det, (a[0][0] * jtr[1] - a[1][0] * jtr[0]) / det];
        let candidate = [b[0] - step[0], b[1] - step[1]];
        let candidate_cost = residual_sum(form, candidate, rounds, horizon);
        if candidate_cost < cost {
            let improvement = cost - candidate_cost;
            b = candidate;
            cost = candidate_cost;
            damping = (damping / 3.0).max(1e-12);
            if improvement < 1e-12 * cost.max(1.0) {
                break;
            }
        } else {
            damping *= 4.0;
            if damping > 1e12 {
                break;
            }
        }
    }
    let total: f64 = rounds.iter().map(|r| (r.accepted - mean_a).powi(2)).sum();
    let deciles = deciles(rounds);
    Some(Fit {
        form,
        b0: b[0],
        b1: b[1].min(25.0),
        r2_rounds: 1.0 - cost / total,
        r2_deciles: r2_of_curve(form, b, &deciles, horizon),
    })
}

/// JᵀJ and Jᵀr of the residuals at `b` (central differences).
fn normal_equations(form: Form, b: [f64; 2], rounds: &[Round], horizon: usize) -> ([[f64; 2]; 2], [f64; 2]) {
    let (mut jtj, mut jtr) = ([[0.0; 2]; 2], [0.0; 2]);
    let eps = 1e-6;
    for r in rounds {
        let value = |b0: f64, b1: f64| expected_accepted(form, b0, b1, r.entropy, horizon);
        let residual = value(b[0], b[1]) - r.accepted;
        let j = [
            (value(b[0] + eps, b[1]) - value(b[0] - eps, b[1])) / (2.0 * eps),
            (value(b[0], b[1] + eps) - value(b[0], b[1] - eps)) / (2.0 * eps),
        ];
        for (row, &ji) in j.iter().enumerate() {
            jtr[row] += ji * residual;
            for (col, &jk) in j.iter().enumerate() {
                jtj[row][col] += ji * jk;
            }
        }
    }
    (jtj, jtr)
}

/// Ten entropy-quantile bins (fewer when rounds are few); bins with under 5 rounds are dropped.
pub fn deciles(rounds: &[Round]) -> Vec<Decile> {
    let mut sorted = rounds.to_vec();
    sorted.sort_by(|a, b| a.entropy.total_cmp(&b.entropy));
    let n = sorted.len();
    (0..10)
        .filter_map(|bin| {
            let (from, to) = (bin * n / 10, (bin + 1) * n / 10);
            let slice = &sorted[from..to];
            (slice.len() >= 5).then(|| Decile {
                entropy: slice.iter().map(|r| r.entropy).sum::<f64>() / slice.len() as f64,
                accepted: slice.iter().map(|r| r.accepted).sum::<f64>() / slice.len() as f64,
                rounds: slice.len(),
            })
        })
        .collect()
}

fn r2_of_curve(form: Form, b: [f64; 2], deciles: &[Decile], horizon: usize) -> f64 {
    let mean = deciles.iter().map(|d| d.accepted).sum::<f64>() / deciles.len().max(1) as f64;
    let total: f64 = deciles.iter().map(|d| (d.accepted - mean).powi(2)).sum();
    let residual: f64 = deciles
        .iter()
        .map(|d| (expected_accepted(form, b[0], b[1], d.entropy, horizon) - d.accepted).powi(2))
        .sum();
    if total > 0.0 {
        1.0 - residual / total
    } else {
        0.0
    }
}

/// Spearman's rank correlation of entropy and accepted length (ties get average ranks).
pub fn spearman(rounds: &[Round]) -> f64 {
    let x = ranks(&rounds.iter().map(|r| r.entropy).collect::<Vec<_>>());
    let y = ranks(&rounds.iter().map(|r| r.accepted).collect::<Vec<_>>());
    pearson(&x, &y)
}

fn ranks(values: &[f64]) -> Vec<f64> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[a].total_cmp(&values[b]));
    let mut ranks = vec![0.0; values.len()];
    let mut i = 0;
    while i < order.len() {
        let mut j = i;
        while j + 1 < order.len() && values[order[j + 1]] == values[order[i]] {
            j += 1;
        }
        let average = (i + j) as f64 / 2.0 + 1.0;
        for &k in &order[i..=j] {
            ranks[k] = average;
        }
        i = j + 1;
    }
    ranks
}

fn pearson(x: &[f64], y: &[f64]) -> f64 {
    let n = x.len() as f64;
    let (mx, my) = (x.iter().sum::<f64>() / n, y.iter().sum::<f64>() / n);
    let cov: f64 = x.iter().zip(y).map(|(a, b)| (a - mx) * (b - my)).sum();
    let (vx, vy): (f64, f64) =
        (x.iter().map(|a| (a - mx).powi(2)).sum(), y.iter().map(|b| (b - my).powi(2)).sum());
    if vx > 0.0 && vy > 0.0 {
        cov / (vx * vy).sqrt()
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rounds whose accepted lengths follow the law exactly.
    fn synthetic(form: Form, b0: f64, b1: f64) -> Vec<Round> {
        (0..200)
            .map(|i| {
                let entropy = i as f64 * 0.02;
                Round { entropy, accepted: expected_accepted(form, b0, b1, entropy, 15) }
            })
            .collect()
    }

    #[test]
    fn recovers_the_parameters_of_both_forms() {
        for form in [Form::CappedGeometric, Form::FiniteHorizon] {
            let fitted = fit(form, &synthetic(form, 0.96, 0.63), 15).expect("a fit");
            assert!(
                (fitted.b0 - 0.96).abs() < 1e-3 && (fitted.b1 - 0.63).abs() < 1e-3,
                "{form:?}: {fitted:?}"
            );
            assert!(fitted.r2_rounds > 0.999 && fitted.r2_deciles > 0.999);
        }
    }

    #[test]
    fn spearman_sees_a_falling_relation_and_handles_ties() {
        let rounds: Vec<Round> =
            (0..50).map(|i| Round { entropy: i as f64, accepted: (50 - i) as f64 / 10.0 }).collect();
        assert!((spearman(&rounds) + 1.0).abs() < 1e-12);
        assert_eq!(ranks(&[3.0, 1.0, 3.0, 2.0]), vec![3.5, 1.0, 3.5, 2.0]);
    }

    #[test]
    fn deciles_drop_thin_bins_and_average_the_rest() {
        let rounds = synthetic(Form::FiniteHorizon, 1.0, 1.0);
        let bins = deciles(&rounds);
        assert_eq!(bins.len(), 10);
        assert!(bins.windows(2).all(|w| w[0].entropy < w[1].entropy && w[0].accepted > w[1].accepted));
        assert!(deciles(&rounds[..20]).is_empty());
        assert!(fit(Form::FiniteHorizon, &rounds[..10], 15).is_none());
    }
}

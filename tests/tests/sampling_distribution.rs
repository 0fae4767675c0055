//! Speculative sampling is lossless in distribution: a statistical test with teeth.
//!
//! On the tiny Llama, a short fixed prompt, temperature 1 with top-k 3 (27 outcomes for three
//! tokens), the exact joint distribution `p` of the first three sampled tokens is computed from the
//! target itself (p(t1)·p(t2|t1)·p(t3|t1,t2), 13 teacher-forced passes). Each sampler under test
//! draws `SAMPLES` triples on its own disjoint block of seeds, and Pearson's chi-square
//! goodness-of-fit test against `p` (cells with an expected count under 5 pooled) must not reject
//! at `ALPHA` = 1e-3: autoregressive sampling, and speculative sampling with an oracle-like tree
//! (the target's own top tokens), an oracle-like chain and a random tree.
//!
//! Teeth, two kinds:
//! - Power at total variation 0.02, measured: for the least detectable shift of that size (mass
//!   moved in proportion to `p` from one half of the outcomes to the other, which minimises the
//!   chi-square's noncentrality, 4·n·TV²), samples of `SAMPLES` from the shifted distribution are
//!   rejected in at least 90% of 40 trials, and samples from `p` itself in at most 2 of 40.
//! - Wrong samplers, run on the same exact distributions and rejected: accepting a child whenever
//!   its token is in the target's top-2 at the node; drawing below the root from the drafter's
//!   distribution (a flatter one) instead of the target's; one uniform for a whole round instead
//!   of one per generated index.
//!
//! Sample size: `SAMPLES` = 40,000 per sampler. With 26 degrees of freedom the critical value at
//! 1e-3 is 54.1; the worst-case shift of TV 0.02 gives a noncentrality of 4·40000·0.02² = 64, a
//! mean statistic of 90 and a power of about 0.98 (at 30,000 it measured 36 of 40: too close).
//! About 45 s per sampler on one core; the five tests run side by side.

use std::collections::HashMap;

use glance_models::decode::{generate, teacher_forced, GreedyParams, ModelInputs, StepControl};
use glance_models::readout::log_probs;
use glance_models::sampling::Sampling;
use glance_models::{LogitRows, TargetModel};
use glance_spec::tree::Tree;
use glance_tests::drafters::FnProvider;
use glance_tests::fixtures;
use statrs::distribution::{ChiSquared, ContinuousCDF};
use tch::Kind;
use verifier_svc::speculative::{speculative_generate, SpecParams};

const SAMPLES: usize = 40_000;
/// `GLANCE_DIST_SAMPLES` overrides it for a quick look; the power check then measures the power
/// of that size (and fails when it is too small), so a smaller run cannot pass unnoticed as a
/// test with teeth.
fn samples() -> usize {
    std::env::var("GLANCE_DIST_SAMPLES").ok().and_then(|v| v.parse().ok()).unwrap_or(SAMPLES)
}
const ALPHA: f64 = 1e-3;
const TOKENS: usize = 3;
const SAMPLING: Sampling = Sampling { temperature: 1.0, top_k: 3, top_p: 1.0, min_p: 0.0, seed: 0 };
/// The drafter a wrong sampler borrows its probabilities from: the same tokens, flatter.
const DRAFTER: Sampling = Sampling { temperature: 2.0, ..SAMPLING };

type Outcome = [i64; TOKENS];

/// The processed next-token distribution after each prefix of generated tokens (of up to two),
/// as (token, probability) best first, under `SAMPLING` and under `DRAFTER`.
struct Exact {
    target: HashMap<Vec<i64>, Vec<(i64, f64)>>,
    drafter: HashMap<Vec<i64>, Vec<(i64, f64)>>,
}

impl Exact {
    fn compute(model: &TargetModel, inputs: &ModelInputs) -> Exact {
        let mut exact = Exact { target: HashMap::new(), drafter: HashMap::new() };
        let mut prefixes = vec![Vec::new()];
        while let Some(prefix) = prefixes.pop() {
            let forced = teacher_forced(model, inputs, &prefix, &[], LogitRows::Last).expect("forward");
            let logits = match forced.continuation {
                None => forced.prompt_logits,
                Some(out) => out.logits.expect("logits"),
            };
            let target = distribution(&logits, &SAMPLING);
            if prefix.len() + 1 < TOKENS {
                prefixes.extend(target.iter().map(|&(t, _)| prefix.iter().copied().chain([t]).collect()));
            }
            exact.drafter.insert(prefix.clone(), distribution(&logits, &DRAFTER));
            exact.target.insert(prefix, target);
        }
        exact
    }

    fn joint(&self) -> HashMap<Outcome, f64> {
        let mut joint = HashMap::new();
        for (a, pa) in &self.target[&vec![]] {
            for (b, pb) in &self.target[&vec![*a]] {
                for (c, pc) in &self.target[&vec![*a, *b]] {
                    joint.insert([*a, *b, *c], pa * pb * pc);
                }
            }
        }
        joint
    }
}

/// The nonzero probabilities of the last row, best first.
fn distribution(logits: &tch::Tensor, sampling: &Sampling) -> Vec<(i64, f64)> {
    let probs = log_probs(logits, sampling).exp().view([-1]);
    let probs = Vec::<f32>::try_from(probs).expect("f32");
    let mut kept: Vec<(i64, f64)> =
        probs.iter().enumerate().filter(|(_, &p)| p > 0.0).map(|(t, &p)| (t as i64, f64::from(p))).collect();
    kept.sort_by(|a, b| b.1.total_cmp(&a.1));
    kept
}

/// Inverse-CDF draw of a uniform in [0, 1) from (outcome, probability) pairs.
fn draw<T: Copy>(table: &[(T, f64)], u: f64) -> T {
    let mut mass = 0.0;
    for &(outcome, p) in table {
        mass += p;
        if u < mass {
            return outcome;
        }
    }
    table.last().expect("an outcome with mass").0
}

/// SplitMix64 as the tests' own uniform source (independent of the product's seeded draws).
struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Pearson's goodness-of-fit statistic and p-value of observed outcome counts against `p`, cells
/// of expected count under 5 pooled into one.
fn chi_square(counts: &HashMap<Outcome, usize>, p: &HashMap<Outcome, f64>) -> (f64, f64) {
    let n: usize = counts.values().sum();
    let (mut statistic, mut cells) = (0.0, 0usize);
    let (mut pooled_expected, mut pooled_observed) = (0.0, 0.0);
    for (outcome, &prob) in p {
        let expected = prob * n as f64;
        let observed = counts.get(outcome).copied().unwrap_or(0) as f64;
        if expected < 5.0 {
            pooled_expected += expected;
            pooled_observed += observed;
        } else {
            statistic += (observed - expected).powi(2) / expected;
            cells += 1;
        }
    }
    // Outcomes outside p's support (probability 0) join the pool: any of them is a failure.
    pooled_observed +=
        counts.iter().filter(|(o, _)| !p.contains_key(*o)).map(|(_, &c)| c as f64).sum::<f64>();
    if pooled_expected > 0.0 || pooled_observed > 0.0 {
        let expected = pooled_expected.max(1e-9);
        statistic += (pooled_observed - expected).powi(2) / expected;
        cells += 1;
    }
    let dof = (cells - 1) as f64;
    (statistic, 1.0 - ChiSquared::new(dof).expect("dof > 0").cdf(statistic))
}

fn total_variation(counts: &HashMap<Outcome, usize>, p: &HashMap<Outcome, f64>) -> f64 {
    let n: usize = counts.values().sum();
    let mut outcomes: Vec<&Outcome> = p.keys().chain(counts.keys()).collect();
    outcomes.sort();
    outcomes.dedup();
    let freq = |o: &Outcome| counts.get(o).copied().unwrap_or(0) as f64 / n as f64;
    outcomes.iter().map(|o| (freq(o) - p.get(*o).copied().unwrap_or(0.0)).abs()).sum::<f64>() / 2.0
}

fn counts_of(samples: impl IntoIterator<Item = Outcome>) -> HashMap<Outcome, usize> {
    let mut counts = HashMap::new();
    for outcome in samples {
        *counts.entry(outcome).or_insert(0) += 1;
    }
    counts
}

/// A short prompt of the tiny Llama (any tokens will do: the test is about the sampler).
fn fixture() -> Option<(TargetModel, ModelInputs)> {
    let root = fixtures()?;
    // One libtorch thread: the passes are tiny, and the tests of this file run side by side.
    tch::set_num_threads(1);
    let model =
        TargetModel::load(&root.join("tiny-llama"), Kind::Float, glance_tests::test_device()).expect("model");
    let ids = vec![1i64, 40, 300, 7, 512];
    let n = ids.len() as i64;
    let positions = [(0..n).collect(), (0..n).collect(), (0..n).collect()];
    Some((
        model,
        ModelInputs { input_ids: ids, positions, rope_delta: 0, pixel_values: None, image_grids: Vec::new() },
    ))
}

fn params() -> GreedyParams<'static> {
    GreedyParams { max_new_tokens: TOKENS, eos_token_ids: &[], context_limit: 64, logprobs: None }
}

fn outcome(tokens: &[i64]) -> Outcome {
    tokens.try_into().expect("three tokens")
}

/// Checks one sampler's samples against `p`; returns the p-value.
fn verdict(what: &str, counts: &HashMap<Outcome, usize>, p: &HashMap<Outcome, f64>) -> f64 {
    let (statistic, p_value) = chi_square(counts, p);
    println!(
        "{what}: {} samples, {} outcomes, chi-square {statistic:.1}, p-value {p_value:.3e}, empirical TV {:.4}",
        counts.values().sum::<usize>(),
        counts.len(),
        total_variation(counts, p)
    );
    p_value
}

/// The seeds of sampler `block`: disjoint from every other block's.
fn seeds(block: u64) -> impl Iterator<Item = u64> {
    (0..samples() as u64).map(move |i| block * 1_000_000 + i)
}

#[test]
fn autoregressive_sampling_fits_the_exact_distribution() {
    let Some((model, inputs)) = fixture() else { return };
    let _no_grad = tch::no_grad_guard();
    let p = Exact::compute(&model, &inputs).joint();
    let params = params();
    let samples = seeds(0).map(|seed| {
        let sampling = Sampling { seed, ..SAMPLING };
        outcome(&generate(&model, &inputs, &params, &sampling, |_| StepControl::Continue).expect("AR").tokens)
    });
    assert!(verdict("autoregressive", &counts_of(samples), &p) >= ALPHA);
}

/// The oracle-like tree: below the root, the target's own top `width` tokens at each node, two
/// levels deep (`width` 1: a chain). A fixed function of the context, as a drafter's tree is.
fn oracle_tree(exact: &Exact, generated: &[i64], root: i64, width: usize) -> Tree {
    let mut tree = Tree::default();
    let prefix: Vec<i64> = generated.iter().copied().chain([root]).collect();
    let Some(first) = exact.target.get(&prefix) else { return tree };
    for &(a, _) in first.iter().take(width) {
        let node = tree.push(a as u32, -1, 0.0);
        let deeper: Vec<i64> = prefix.iter().copied().chain([a]).collect();
        for &(b, _) in exact.target.get(&deeper).into_iter().flatten().take(width) {
            tree.push(b as u32, node, 0.0);
        }
    }
    tree
}

/// A random tree drawn from the context (its hash seeds it): 1-3 children per node, two levels,
/// each token one of the target's top 3 there or an arbitrary one, at even odds.
fn random_tree(exact: &Exact, generated: &[i64], root: i64) -> Tree {
    let key =
        generated.iter().chain([&root]).fold(0x5EED_u64, |h, &t| h.wrapping_mul(31).wrapping_add(t as u64));
    let mut rng = Rng(key);
    let mut tree = Tree::default();
    let pick = |rng: &mut Rng, prefix: &[i64]| -> i64 {
        let top = exact.target.get(prefix).filter(|_| rng.uniform() < 0.5);
        match top {
            Some(dist) => dist[(rng.uniform() * dist.len() as f64) as usize].0,
            None => (rng.uniform() * 1024.0) as i64,
        }
    };
    let prefix: Vec<i64> = generated.iter().copied().chain([root]).collect();
    for _ in 0..1 + (rng.uniform() * 3.0) as usize {
        let a = pick(&mut rng, &prefix);
        let node = tree.push(a as u32, -1, 0.0);
        let deeper: Vec<i64> = prefix.iter().copied().chain([a]).collect();
        for _ in 0..(rng.uniform() * 3.0) as usize {
            tree.push(pick(&mut rng, &deeper) as u32, node, 0.0);
        }
    }
    tree
}

/// Speculative sampling with the tree `make` draws, on seed block `block`.
fn speculative_samples(
    model: &TargetModel,
    inputs: &ModelInputs,
    block: u64,
    make: impl Fn(&[i64], i64) -> Tree + Clone + 'static,
) -> (HashMap<Outcome, usize>, f64) {
    let prompt_len = inputs.input_ids.len();
    let params = params();
    let (mut committed, mut rounds) = (0usize, 0usize);
    let samples: Vec<Outcome> = seeds(block)
        .map(|seed| {
            let make = make.clone();
            let mut provider = FnProvider::new(2, move |context, root, _| make(&context[prompt_len..], root));
            let spec = SpecParams {
                budget: 16,
                branch_k: 3,
                log_rounds: false,
                sampling: Sampling { seed, ..SAMPLING },
            };
            let (generation, stats) =
                speculative_generate(model, inputs, &params, spec, &mut provider, None, |_| {
                    StepControl::Continue
                })
                .expect("speculative");
            committed += stats.committed_in_rounds;
            rounds += stats.rounds;
            outcome(&generation.tokens)
        })
        .collect();
    (counts_of(samples), committed as f64 / rounds.max(1) as f64)
}

/// The drafters speculative sampling is tested with.
#[derive(Clone, Copy, Debug)]
enum Drafter {
    OracleTree,
    OracleChain,
    Random,
}

/// Speculative sampling with `drafter` fits `p` (each drafter on its own block of seeds).
fn speculative_fits(drafter: Drafter, block: u64) {
    let Some((model, inputs)) = fixture() else { return };
    let _no_grad = tch::no_grad_guard();
    let exact = std::rc::Rc::new(Exact::compute(&model, &inputs));
    let p = exact.joint();
    let make = move |generated: &[i64], root: i64| match drafter {
        Drafter::OracleTree => oracle_tree(&exact, generated, root, 3),
        Drafter::OracleChain => oracle_tree(&exact, generated, root, 1),
        Drafter::Random => random_tree(&exact, generated, root),
    };
    let (counts, tau) = speculative_samples(&model, &inputs, block, make);
    let p_value = verdict(&format!("speculative, {drafter:?} (tau {tau:.2})"), &counts, &p);
    assert!(p_value >= ALPHA, "{drafter:?}: speculative sampling does not fit the target's distribution");
    // Three tokens: the prefill draws the first, so a round can commit at most two (a node at depth
    // 1 and the bonus) and verifies nothing deeper. The oracle-like tree offers every token top-k
    // sampling can draw there (tau 2); the chain only the likeliest, drawn about half the time.
    let least = match drafter {
        Drafter::OracleTree => Some(1.9),
        Drafter::OracleChain => Some(1.4),
        Drafter::Random => None,
    };
    if let Some(least) = least {
        assert!(tau > least, "{drafter:?}: the tree was hardly accepted (tau {tau})");
    }
}

#[test]
fn speculative_sampling_with_an_oracle_like_tree_fits_the_exact_distribution() {
    speculative_fits(Drafter::OracleTree, 1);
}

#[test]
fn speculative_sampling_with_an_oracle_like_chain_fits_the_exact_distribution() {
    speculative_fits(Drafter::OracleChain, 2);
}

#[test]
fn speculative_sampling_with_a_random_tree_fits_the_exact_distribution() {
    speculative_fits(Drafter::Random, 3);
}

/// Samplers that are wrong on purpose, simulated on the exact distributions (one round from the
/// root t1 over the oracle-like tree, as the verifier's walk would go).
#[derive(Clone, Copy, Debug)]
enum Wrong {
    /// Accepts a child whenever its token is among the target's top 2 at the node.
    TopTwoAcceptance,
    /// Draws below the root from the drafter's distribution instead of the target's.
    DrafterProbabilities,
    /// One uniform for the whole round instead of one per generated index.
    OneUniformPerRound,
}

fn wrong_sample(exact: &Exact, wrong: Wrong, rng: &mut Rng) -> Outcome {
    let t1 = draw(&exact.target[&vec![]], rng.uniform());
    let round_uniform = rng.uniform();
    let mut tokens = vec![t1];
    while tokens.len() < TOKENS {
        let here = &exact.target[&tokens];
        let token = match wrong {
            Wrong::TopTwoAcceptance => {
                // The oracle-like tree's children here are the target's top 3: one is always in
                // its top 2, so the walk never draws.
                let children: Vec<i64> = here.iter().take(3).map(|&(t, _)| t).collect();
                *children.iter().find(|c| here.iter().take(2).any(|&(t, _)| t == **c)).expect("a top-2 child")
            }
            Wrong::DrafterProbabilities => draw(&exact.drafter[&tokens], rng.uniform()),
            Wrong::OneUniformPerRound => draw(here, round_uniform),
        };
        tokens.push(token);
    }
    outcome(&tokens)
}

#[test]
fn the_test_has_teeth() {
    let Some((model, inputs)) = fixture() else { return };
    let _no_grad = tch::no_grad_guard();
    let exact = Exact::compute(&model, &inputs);
    let p = exact.joint();
    for (block, wrong) in
        (10..).zip([Wrong::TopTwoAcceptance, Wrong::DrafterProbabilities, Wrong::OneUniformPerRound])
    {
        let mut rng = Rng(block);
        let counts = counts_of((0..samples()).map(|_| wrong_sample(&exact, wrong, &mut rng)));
        let p_value = verdict(&format!("wrong sampler {wrong:?}"), &counts, &p);
        assert!(p_value < ALPHA, "{wrong:?} went undetected");
    }

    // Power at TV 0.02 against the least detectable shift, and the false alarms at p itself.
    let shifted = least_detectable_shift(&p, 0.02);
    let trials = 40u64;
    let rejections = |q: &HashMap<Outcome, f64>, seed: u64| {
        let table: Vec<(Outcome, f64)> = q.iter().map(|(o, &w)| (*o, w)).collect();
        (0..trials)
            .filter(|t| {
                let mut rng = Rng(seed + t);
                let counts = counts_of((0..samples()).map(|_| draw(&table, rng.uniform())));
                chi_square(&counts, &p).1 < ALPHA
            })
            .count() as u64
    };
    let (power, false_alarms) = (rejections(&shifted, 1000), rejections(&p, 2000));
    println!("TV 0.02, least detectable shift: {power}/{trials} rejected; p itself: {false_alarms}/{trials} rejected");
    assert!(power * 10 >= trials * 9, "a TV of 0.02 is detected in only {power} of {trials} trials");
    assert!(false_alarms <= 2, "{false_alarms} of {trials} samples of p itself rejected");
}

/// `p` with `tv` of mass moved, in proportion to `p`, from the less likely half of the outcomes to
/// the more likely half: the shift of that total variation with the smallest chi-square
/// noncentrality (by Cauchy-Schwarz, sum of shift²/p >= 4·tv², reached here up to how evenly the
/// halves split).
fn least_detectable_shift(p: &HashMap<Outcome, f64>, tv: f64) -> HashMap<Outcome, f64> {
    let mut sorted: Vec<(Outcome, f64)> = p.iter().map(|(o, &w)| (*o, w)).collect();
    sorted.sort_by(|a, b| b.1.total_cmp(&a.1));
    let mut mass = 0.0;
    let split = sorted.iter().position(|&(_, w)| {
        mass += w;
        mass >= 0.5
    });
    let split = split.expect("mass reaches one half") + 1;
    let upper: f64 = sorted[..split].iter().map(|&(_, w)| w).sum();
    let lower = 1.0 - upper;
    sorted
        .iter()
        .enumerate()
        .map(|(i, &(o, w))| (o, if i < split { w * (1.0 + tv / upper) } else { w * (1.0 - tv / lower) }))
        .collect()
}

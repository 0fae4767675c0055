//! What finished auto requests leave for the next ones: the latest policy (the machine's costs,
//! and what the last request learnt) and, per instruction, the policy the last request of that
//! instruction ended with. Requests of one instruction ("What is written on the page?", a fixed
//! system prompt and question) tend to draft alike whatever their images, and unlike the others:
//! a request of a known instruction starts from its own kind's acceptance, law and probe back-off;
//! any other starts from the latest policy, with a probe.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::num::NonZeroUsize;

use lru::LruCache;

use crate::policy::RoundPolicy;

/// A request's instruction: the hash of its rendered prompt text with the image placeholders
/// unexpanded, so the same question about another image is the same instruction, and of its
/// temperature (a tree that a greedy answer accepts whole, a sampled one may leave at once).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Instruction(u64);

impl Instruction {
    pub fn of(prompt_text: &str, temperature: f64) -> Self {
        let mut hasher = DefaultHasher::new();
        prompt_text.hash(&mut hasher);
        temperature.to_bits().hash(&mut hasher);
        Self(hasher.finish())
    }
}

/// The auto policies finished requests left behind.
#[derive(Debug)]
pub struct PolicyMemory {
    latest: RoundPolicy,
    by_instruction: LruCache<Instruction, RoundPolicy>,
}

impl PolicyMemory {
    /// Instructions remembered, the least recently used forgotten first (a policy is a few KiB).
    const INSTRUCTIONS: NonZeroUsize = NonZeroUsize::new(256).unwrap();

    /// A memory of nothing but `first` (the start-up cost sweep).
    pub fn new(first: RoundPolicy) -> Self {
        Self { latest: first, by_instruction: LruCache::new(Self::INSTRUCTIONS) }
    }

    /// The policy a request of `instruction` starts from, and whether the instruction was known.
    pub fn policy_for(&mut self, instruction: Instruction) -> (RoundPolicy, bool) {
        match self.by_instruction.get(&instruction) {
            Some(earlier) => (earlier.for_same_instruction(&self.latest), true),
            None => (self.latest.for_new_request(), false),
        }
    }

    /// Keeps the policy a finished request of `instruction` ended with.
    pub fn keep(&mut self, instruction: Instruction, policy: RoundPolicy) {
        self.by_instruction.put(instruction, policy.clone());
        self.latest = policy;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::test_support::{costs, simulate};

    /// A request of `instruction` of `steps` rounds against a drafter whose chains of 15 claim
    /// `claimed` per token and are accepted for their first `accepted` nodes; returns how many
    /// times it asked the drafter.
    fn request(
        memory: &mut PolicyMemory,
        instruction: Instruction,
        steps: usize,
        claimed: f64,
        accepted: usize,
    ) -> usize {
        let (mut policy, _) = memory.policy_for(instruction);
        simulate(&mut policy, steps, 15, claimed, accepted);
        let asked = policy.stats.verified_rounds + policy.stats.declined_trees;
        memory.keep(instruction, policy);
        asked
    }

    fn memory() -> PolicyMemory {
        PolicyMemory::new(RoundPolicy::with_costs(costs(0.001, 0.0001)))
    }

    #[test]
    fn a_known_instruction_waits_out_its_back_off_across_requests_and_a_new_one_probes() {
        let mut memory = memory();
        let page = Instruction::of("What is written on the page?", 0.0);
        // A drafter never accepted: past the warm-up rounds (which verify whole trees), the probes
        // back off.
        for _ in 0..8 {
            request(&mut memory, page, 100, 0.9, 0);
        }
        // Short answers of the same instruction: no request opens with a probe, and the back-off
        // (up to 64 steps) spans requests, so a probe still comes every few of them.
        let asked: Vec<usize> = (0..8).map(|_| request(&mut memory, page, 20, 0.9, 0)).collect();
        assert!(asked.iter().sum::<usize>() >= 1, "probes stop altogether: {asked:?}");
        assert!(asked.iter().sum::<usize>() <= 4, "each request probes: {asked:?}");
        // Another instruction opens with a probe, as the first request of any instruction does.
        let chart = Instruction::of("List the bars and their values.", 0.0);
        let (mut policy, known) = memory.policy_for(chart);
        assert!(!known);
        assert!(policy.should_draft(None, 15, 4));
        // Its costs are the machine's as last measured, whichever instruction measured them.
        memory.latest.observe_verify(1, 0.005);
        let (policy, known) = memory.policy_for(page);
        assert!(known);
        assert_eq!(policy.verify.estimate(1), memory.latest.verify.estimate(1));
    }

    #[test]
    fn a_known_instruction_whose_trees_pay_drafts_at_once() {
        let mut memory = memory();
        let chart = Instruction::of("List the bars and their values.", 0.0);
        // Requests whose chains of 15 are accepted whole.
        for _ in 0..4 {
            let (mut policy, _) = memory.policy_for(chart);
            simulate(&mut policy, 40, 15, 0.9, 15);
            assert_eq!(policy.stats.greedy_steps, 0, "{:?}", policy.stats);
            memory.keep(chart, policy);
        }
        // The next request of the instruction asks for a tree at its first round (no wait).
        let (mut policy, known) = memory.policy_for(chart);
        assert!(known);
        assert!(policy.should_draft(None, 15, 4));
    }

    #[test]
    fn the_same_question_about_another_image_at_the_same_temperature_is_the_same_instruction() {
        let template = |question: &str| {
            format!("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{question}<|im_end|>\n")
        };
        let of = |question: &str, temperature| Instruction::of(&template(question), temperature);
        assert_eq!(of("Read the chart.", 0.0), of("Read the chart.", 0.0));
        assert_ne!(of("Read the chart.", 0.0), of("Read the sign.", 0.0));
        assert_ne!(of("Read the chart.", 0.0), of("Read the chart.", 0.7));
    }
}

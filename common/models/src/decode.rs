//! Autoregressive decoding: prefill, then one target forward per token, greedy or sampled. This is
//! the reference that every speculative mode must reproduce token for token, and (greedy) the
//! generator drafter training uses to regenerate responses.

use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};

use crate::readout::{read_rows, Reads, TokenLogprob};
use crate::sampling::{Draw, Sampling};
use crate::{LogitRows, ModelError, StepInput, TargetModel};

/// Everything a forward pass needs about a prompt, already tokenized and preprocessed.
pub struct ModelInputs {
    pub input_ids: Vec<i64>,
    /// M-RoPE positions (t, h, w), each of `input_ids.len()`.
    pub positions: [Vec<i64>; 3],
    /// Decode-time position of stream index p is p + rope_delta on all three axes.
    pub rope_delta: i64,
    /// (patches, patch_dim) f32, all images of the prompt in order.
    pub pixel_values: Option<Tensor>,
    /// Patch grid (t, h, w) per image.
    pub image_grids: Vec<[i64; 3]>,
}

impl ModelInputs {
    pub fn positions_tensor(&self) -> Tensor {
        let flat: Vec<i64> = self.positions.iter().flatten().copied().collect();
        crate::host_tensor(&flat).view([3, self.input_ids.len() as i64])
    }
}

/// What the caller wants after each new token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepControl {
    Continue,
    Stop,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishKind {
    /// An end-of-sequence token was produced (it is the last token).
    Eos,
    /// `max_new_tokens` reached.
    Length,
    /// The caller asked to stop (stop string, cancellation).
    Stopped,
    /// The context window (KV cache) is full.
    Context,
}

pub struct Generation {
    pub tokens: Vec<i64>,
    /// Each token's log-probability, when `logprobs` was asked for (else empty).
    pub logprobs: Vec<TokenLogprob>,
    pub finish: FinishKind,
    /// Vision tower + prefill forward + first token.
    pub prefill_time: Duration,
    /// From the first token to the last.
    pub decode_time: Duration,
}

pub struct GreedyParams<'a> {
    pub max_new_tokens: usize,
    pub eos_token_ids: &'a [i64],
    /// Total positions the cache may hold (prompt + generated).
    pub context_limit: usize,
    /// Report each token's log-probability with this many most likely alternatives (see
    /// [`crate::readout`]); `None`: no log-probabilities.
    pub logprobs: Option<usize>,
}

/// A token as it is committed, with its log-probability when the request asked for it.
#[derive(Clone, Copy, Debug)]
pub struct Emitted<'a> {
    pub token: i64,
    pub logprob: Option<&'a TokenLogprob>,
}

impl GreedyParams<'_> {
    /// Positions a generation from a prompt of `prompt_len` tokens may fill (prompt + new tokens,
    /// within the context limit); an error when the prompt leaves no room.
    pub fn capacity(&self, prompt_len: usize) -> Result<usize, ModelError> {
        let capacity = (prompt_len + self.max_new_tokens).min(self.context_limit);
        if prompt_len >= capacity {
            return Err(ModelError::Input(format!(
                "prompt of {prompt_len} tokens leaves no room in a context of {}",
                self.context_limit
            )));
        }
        Ok(capacity)
    }
}

/// Greedy decoding. `on_token` sees each new token as soon as it is chosen.
pub fn greedy_generate(
    model: &TargetModel,
    inputs: &ModelInputs,
    params: &GreedyParams,
    on_token: impl FnMut(Emitted<'_>) -> StepControl,
) -> Result<Generation, ModelError> {
    generate(model, inputs, params, &Sampling::GREEDY, on_token)
}

/// Autoregressive decoding, greedy or sampled: generated token `i` is the argmax, or the draw
/// with `sampling`'s uniform of index `i` (see [`crate::sampling`]). `on_token` sees each new
/// token as soon as it is chosen, with its log-probability when `params` asks for them.
pub fn generate(
    model: &TargetModel,
    inputs: &ModelInputs,
    params: &GreedyParams,
    sampling: &Sampling,
    mut on_token: impl FnMut(Emitted<'_>) -> StepControl,
) -> Result<Generation, ModelError> {
    let _no_grad = tch::no_grad_guard();
    let started = Instant::now();
    let prompt_len = inputs.input_ids.len();
    let capacity = params.capacity(prompt_len)?;
    let mut cache = model.new_cache(capacity);
    let prefill_span = tracing::info_span!("prefill", prompt_tokens = prompt_len).entered();
    let logits = prefill(model, inputs, &mut cache)?;
    drop(prefill_span);
    let reads = Reads { entropy: false, logprobs: params.logprobs };
    let (mut next, mut logprob) = read_last(&logits, sampling, 0, reads);
    let prefill_time = started.elapsed();
    let decode_started = Instant::now();
    let mut tokens = Vec::with_capacity(params.max_new_tokens);
    let mut logprobs = Vec::new();
    let finish = loop {
        tokens.push(next);
        logprobs.extend(logprob.take());
        if params.eos_token_ids.contains(&next) {
            break FinishKind::Eos;
        }
        let emitted = Emitted { token: next, logprob: logprobs.last() };
        if on_token(emitted) == StepControl::Stop {
            break FinishKind::Stopped;
        }
        if tokens.len() >= params.max_new_tokens {
            break FinishKind::Length;
        }
        if cache.len() >= capacity {
            break FinishKind::Context;
        }
        let out = forward_token(model, &mut cache, next, inputs.rope_delta, &[])?;
        let logits = out.logits.as_ref().expect("logits were requested");
        (next, logprob) = read_last(logits, sampling, tokens.len() as u64, reads);
    };
    Ok(Generation { tokens, logprobs, finish, prefill_time, decode_time: decode_started.elapsed() })
}

/// One decode step: `token` forwarded at the next position (M-RoPE decode positions are the
/// stream index + `rope_delta` on all three axes), the last row's logits and the `taps` outputs.
pub fn forward_token(
    model: &TargetModel,
    cache: &mut crate::kv_cache::KvCache,
    token: i64,
    rope_delta: i64,
    taps: &[usize],
) -> Result<crate::StepOutput, ModelError> {
    let position = cache.len() as i64 + rope_delta;
    // One upload that does not block the host: [token, t, h, w].
    let host = crate::upload(&[token, position, position, position], model.device());
    let ids = host.narrow(0, 0, 1);
    let positions = host.narrow(0, 1, 3).view([3, 1]);
    let step = StepInput {
        token_ids: &ids,
        positions: &positions,
        mask: None,
        vision: None,
        taps,
        logits: LogitRows::Last,
    };
    model.forward(&step, cache)
}

/// Runs the vision tower and the prompt forward; returns the last row's logits (1, vocab).
pub fn prefill(
    model: &TargetModel,
    inputs: &ModelInputs,
    cache: &mut crate::kv_cache::KvCache,
) -> Result<Tensor, ModelError> {
    prefill_with_taps(model, inputs, cache, &[]).map(|(logits, _)| logits)
}

/// Like [`prefill`], also returning the outputs of the `taps` decoder layers for every prompt
/// position, concatenated: (prompt, taps·hidden); `None` when no tap is asked for.
pub fn prefill_with_taps(
    model: &TargetModel,
    inputs: &ModelInputs,
    cache: &mut crate::kv_cache::KvCache,
    taps: &[usize],
) -> Result<(Tensor, Option<Tensor>), ModelError> {
    let device = model.device();
    let vision = match &inputs.pixel_values {
        Some(pixels) if !inputs.image_grids.is_empty() => {
            Some(model.encode_images(pixels, &inputs.image_grids)?)
        }
        _ => None,
    };
    let ids = crate::upload(&inputs.input_ids, device);
    let positions = crate::upload_tensor(&inputs.positions_tensor(), device);
    let step = StepInput {
        token_ids: &ids,
        positions: &positions,
        mask: None,
        vision: vision.as_ref(),
        taps,
        logits: LogitRows::Last,
    };
    let out = model.forward(&step, cache)?;
    let states = (!out.taps.is_empty()).then(|| Tensor::cat(&out.taps, -1));
    Ok((out.logits.expect("logits were requested"), states))
}

/// A teacher-forced pass over a prompt and a given continuation, in a fresh cache.
pub struct TeacherForced {
    /// The prefill's last-row logits (1, vocab): the distribution of the continuation's first token.
    pub prompt_logits: Tensor,
    /// The prompt's tap states (prompt, taps·hidden), when taps were asked for.
    pub prompt_states: Option<Tensor>,
    /// The continuation's pass (logits per `logits`, taps); `None` for an empty continuation.
    pub continuation: Option<crate::StepOutput>,
}

/// The prompt's prefill (with its images), then `continuation` in one causal pass at the text
/// positions after it (a continuation token that happens to be an image placeholder is not taken
/// for an image).
pub fn teacher_forced(
    model: &TargetModel,
    inputs: &ModelInputs,
    continuation: &[i64],
    taps: &[usize],
    logits: LogitRows,
) -> Result<TeacherForced, ModelError> {
    let n = inputs.input_ids.len();
    let mut cache = model.new_cache(n + continuation.len());
    let (prompt_logits, prompt_states) = prefill_with_taps(model, inputs, &mut cache, taps)?;
    if continuation.is_empty() {
        return Ok(TeacherForced { prompt_logits, prompt_states, continuation: None });
    }
    let device = model.device();
    let count = continuation.len() as i64;
    let start = n as i64 + inputs.rope_delta;
    let positions =
        Tensor::arange_start(start, start + count, (Kind::Int64, device)).view([1, count]).repeat([3, 1]);
    let step = StepInput {
        token_ids: &crate::upload(continuation, device),
        positions: &positions,
        mask: None,
        vision: None,
        taps,
        logits,
    };
    let continuation = model.forward(&step, &mut cache)?;
    Ok(TeacherForced { prompt_logits, prompt_states, continuation: Some(continuation) })
}

/// The token chosen from the last row of `logits` (its argmax, or the draw of generated index
/// `index`) and its log-probability when `reads` asks: one upload of the uniform when sampling,
/// one read-back.
pub fn read_last(
    logits: &Tensor,
    sampling: &Sampling,
    index: u64,
    reads: Reads,
) -> (i64, Option<TokenLogprob>) {
    let rows = logits.size()[0];
    let numerator = Draw { sampling: *sampling, index }.upload_single_row(logits.device());
    let read = read_rows(&logits.narrow(0, rows - 1, 1), sampling, numerator.as_ref(), reads);
    (read.choices[0], read.logprobs.into_iter().next())
}

/// Greedy choice over the last row, in f32 (ties go to the lowest id, as torch's argmax).
pub fn argmax_last(logits: &Tensor) -> i64 {
    let rows = logits.size()[0];
    crate::read_i64(&logits.get(rows - 1).to_kind(Kind::Float).argmax(0, false))
}

/// Greedy decoding of several prompts at once, left-padded to one length and advancing
/// together (each step is one pass over `batch` rows), for throughput where no one waits on a
/// single stream: the training data regeneration. Each prompt is prefilled on its own (no compute
/// spent on padding) and its K/V spliced into the batch. Each sequence ends at EOS or `max_new_tokens`
/// as [`greedy_generate`] would; finished sequences ride along until all are done. In exact
/// arithmetic the tokens equal [`greedy_generate`]'s; a batched matmul sums in another order,
/// so at a near-tie a token may differ. A prompt with images is prefilled with its own vision
/// features; its M-RoPE offset (`rope_delta`) carries into its decode positions.
pub fn greedy_generate_batch(
    model: &TargetModel,
    inputs: &[&ModelInputs],
    params: &GreedyParams,
) -> Result<Vec<Vec<i64>>, ModelError> {
    let sequences = greedy_generate_batch_with_taps(model, inputs, params, &[])?;
    Ok(sequences.into_iter().map(|s| s.tokens).collect())
}

/// One sequence of [`greedy_generate_batch_with_taps`].
pub struct BatchedSequence {
    pub tokens: Vec<i64>,
    /// The tap states of prompt + tokens, (prompt + tokens, taps·hidden): what a teacher-forced
    /// pass over the tokens gives (up to a batched matmul's summation order). `None` when no tap
    /// was asked for, or when the context filled before the last token was passed through.
    pub states: Option<Tensor>,
}

/// [`greedy_generate_batch`], also keeping the `taps` layers' outputs of every position it
/// passes through: the prompt's from its prefill, each token's from the step that reads it (one
/// step more at the end, for the tokens chosen last). Drafter training needs exactly these states,
/// and reading them here spares it a second, teacher-forced pass over every row.
pub fn greedy_generate_batch_with_taps(
    model: &TargetModel,
    inputs: &[&ModelInputs],
    params: &GreedyParams,
    taps: &[usize],
) -> Result<Vec<BatchedSequence>, ModelError> {
    let _no_grad = tch::no_grad_guard();
    let Some(longest) = inputs.iter().map(|i| i.input_ids.len()).max() else { return Ok(vec![]) };
    let capacity = params.capacity(longest)?;
    let batch = inputs.len();
    let (kind, device) = (model.kind(), model.device());
    let mut cache = model.text.new_batched_cache(batch, capacity, kind, device);
    let padded = PaddedBatch::new(inputs, longest);
    let mut next = Vec::with_capacity(batch);
    let mut states: Vec<Vec<Tensor>> = Vec::with_capacity(batch);
    for (b, input) in inputs.iter().enumerate() {
        let mut single = model.new_cache(input.input_ids.len());
        let (logits, prompt_states) = prefill_with_taps(model, input, &mut single, taps)?;
        next.push(argmax_last(&logits));
        states.push(prompt_states.into_iter().collect());
        cache.splice_sequence(b, &single, padded.pads[b])?;
    }
    let mut tokens: Vec<Vec<i64>> = vec![Vec::new(); batch];
    let mut done = vec![false; batch];
    for step in 0.. {
        // The sequences whose newest token this step's pass reads (the rest ride along).
        let mut reading = vec![false; batch];
        for (b, &token) in next.iter().enumerate() {
            if !done[b] {
                tokens[b].push(token);
                reading[b] = true;
                done[b] = params.eos_token_ids.contains(&token) || tokens[b].len() >= params.max_new_tokens;
            }
        }
        let states_wanted = !taps.is_empty() && reading.contains(&true);
        if (done.iter().all(|&d| d) && !states_wanted) || cache.len() >= capacity {
            break;
        }
        let positions: Vec<i64> =
            (0..3).flat_map(|_| padded.next_positions.iter().map(|p| p + step)).collect();
        let decode = StepInput {
            token_ids: &crate::upload(&next, device),
            positions: &crate::upload(&positions, device).view([3, batch as i64]),
            mask: Some(&padded.decode_mask(cache.len(), kind, device)),
            vision: None,
            taps,
            logits: LogitRows::Last,
        };
        let out = model.forward(&decode, &mut cache)?;
        if !taps.is_empty() {
            let rows = Tensor::cat(&out.taps, -1); // (batch, taps·hidden)
            for b in (0..batch).filter(|&b| reading[b]) {
                states[b].push(rows.narrow(0, b as i64, 1));
            }
        }
        let logits = out.logits.expect("logits were requested");
        next = Vec::<i64>::try_from(logits.to_kind(Kind::Float).argmax(-1, false))
            .map_err(|e| ModelError::Input(e.to_string()))?;
    }
    let sequences = tokens.into_iter().zip(states).map(|(tokens, states)| {
        // The prompt's states and one row per token read, or the context filled first.
        let complete = !states.is_empty() && states.len() == 1 + tokens.len();
        BatchedSequence { states: complete.then(|| Tensor::cat(&states, 0)), tokens }
    });
    Ok(sequences.collect())
}

/// Prompts left-padded to one length: sequence b's prompt sits at columns pad_b..longest.
struct PaddedBatch {
    pads: Vec<usize>,
    /// Each sequence's first decode position (prompt length + rope delta).
    next_positions: Vec<i64>,
}

impl PaddedBatch {
    fn new(inputs: &[&ModelInputs], longest: usize) -> Self {
        let pads = inputs.iter().map(|i| longest - i.input_ids.len()).collect();
        let next_positions = inputs.iter().map(|i| i.input_ids.len() as i64 + i.rope_delta).collect();
        Self { pads, next_positions }
    }

    /// (batch, 1, past + 1): everything but the sequence's own pad columns.
    fn decode_mask(&self, past: usize, kind: Kind, device: Device) -> Tensor {
        let width = past + 1;
        let mut mask = vec![0f32; self.pads.len() * width];
        for (b, &pad) in self.pads.iter().enumerate() {
            mask[b * width..][..pad].fill(f32::NEG_INFINITY);
        }
        crate::upload(&mask, device).view([self.pads.len() as i64, 1, width as i64]).to_kind(kind)
    }
}

//! Greedy decoding: prefill, then one target forward per token. This is the reference that every
//! speculative mode must reproduce token for token, and the generator drafter training uses to
//! regenerate responses.

use std::time::{Duration, Instant};

use tch::{Kind, Tensor};

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
        Tensor::from_slice(&flat).view([3, self.input_ids.len() as i64])
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
    mut on_token: impl FnMut(i64) -> StepControl,
) -> Result<Generation, ModelError> {
    let _no_grad = tch::no_grad_guard();
    let started = Instant::now();
    let prompt_len = inputs.input_ids.len();
    let capacity = params.capacity(prompt_len)?;
    let mut cache = model.new_cache(capacity);
    let prefill_span = tracing::info_span!("prefill", prompt_tokens = prompt_len).entered();
    let logits = prefill(model, inputs, &mut cache)?;
    drop(prefill_span);
    let mut next = argmax_last(&logits);
    let prefill_time = started.elapsed();
    let decode_started = Instant::now();
    let mut tokens = Vec::with_capacity(params.max_new_tokens);
    let finish = loop {
        tokens.push(next);
        if params.eos_token_ids.contains(&next) {
            break FinishKind::Eos;
        }
        if on_token(next) == StepControl::Stop {
            break FinishKind::Stopped;
        }
        if tokens.len() >= params.max_new_tokens {
            break FinishKind::Length;
        }
        if cache.len() >= capacity {
            break FinishKind::Context;
        }
        let out = forward_token(model, &mut cache, next, inputs.rope_delta, &[])?;
        next = argmax_last(out.logits.as_ref().expect("logits were requested"));
    };
    Ok(Generation { tokens, finish, prefill_time, decode_time: decode_started.elapsed() })
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
    let ids = Tensor::from_slice(&inputs.input_ids).to_device(device);
    let positions = inputs.positions_tensor().to_device(device);
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
        token_ids: &Tensor::from_slice(continuation).to_device(device),
        positions: &positions,
        mask: None,
        vision: None,
        taps,
        logits,
    };
    let continuation = model.forward(&step, &mut cache)?;
    Ok(TeacherForced { prompt_logits, prompt_states, continuation: Some(continuation) })
}

/// Greedy choice over the last row, in f32 (ties go to the lowest id, as torch's argmax).
pub fn argmax_last(logits: &Tensor) -> i64 {
    let rows = logits.size()[0];
    logits.get(rows - 1).to_kind(Kind::Float).argmax(0, false).int64_value(&[])
}

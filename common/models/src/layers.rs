//! Building blocks shared by the Qwen-VL families: linear layers, norms, rotary embeddings and
//! attention, with the numerics of the Hugging Face reference (norms and rotary angles in f32).

use tch::{Device, Kind, Tensor};

use crate::skinny_gemm::{self, WeightRows};
use crate::weights::{Checkpoint, WeightsError};

/// `y = x Wᵀ + b`.
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    /// Loads `{prefix}.weight` (out, in) and, when `bias` is true, `{prefix}.bias` (out).
    pub fn load(
        ckpt: &mut Checkpoint,
        prefix: &str,
        in_dim: i64,
        out_dim: i64,
        bias: bool,
    ) -> Result<Self, WeightsError> {
        Self::load_with(ckpt, prefix, [out_dim, in_dim], bias, Checkpoint::take_matrix)
    }

    /// Like [`Linear::load`], the weight kept as stored: for parts about to be fused, whose
    /// concatenation gets the fast layout once.
    fn load_as_stored(
        ckpt: &mut Checkpoint,
        prefix: &str,
        in_dim: i64,
        out_dim: i64,
        bias: bool,
    ) -> Result<Self, WeightsError> {
        Self::load_with(ckpt, prefix, [out_dim, in_dim], bias, Checkpoint::take)
    }

    /// The weight (out, in) by `take_weight`, the bias (out) when `bias`.
    fn load_with(
        ckpt: &mut Checkpoint,
        prefix: &str,
        [out_dim, in_dim]: [i64; 2],
        bias: bool,
        take_weight: fn(&mut Checkpoint, &str, &[i64]) -> Result<Tensor, WeightsError>,
    ) -> Result<Self, WeightsError> {
        let weight = take_weight(ckpt, &format!("{prefix}.weight"), &[out_dim, in_dim])?;
        let bias = bias.then(|| ckpt.take(&format!("{prefix}.bias"), &[out_dim])).transpose()?;
        Ok(Self { weight, bias })
    }

    /// A bias that exists only in some checkpoints is loaded when present.
    pub fn load_optional_bias(
        ckpt: &mut Checkpoint,
        prefix: &str,
        in_dim: i64,
        out_dim: i64,
    ) -> Result<Self, WeightsError> {
        let has_bias = ckpt.contains(&format!("{prefix}.bias"));
        Self::load(ckpt, prefix, in_dim, out_dim, has_bias)
    }

    pub fn from_weight(weight: Tensor) -> Self {
        Self { weight, bias: None }
    }

    pub fn from_parts(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self { weight, bias }
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        linear(x, &self.weight, self.bias.as_ref())
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
}

/// `x Wᵀ + b` for `x` (…, in) and `weight` (out, in), by the fastest route this device has for
/// the weight's dtype and layout ([`Route`]). Every frozen matrix product of the model library and
/// the draft heads goes through here.
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Tensor {
    match Route::of(x, weight) {
        Route::Libtorch => x.linear(weight, bias),
        Route::FewRows => few_rows(x, weight, bias),
        Route::F32Blocks => in_f32_blocks(x, weight, bias),
    }
}

/// Passes of at most this many rows take [`Route::FewRows`]: measured on one core of a Zen 3 EPYC
/// (AVX2), the kernel beats the bf16 weight in f32 blocks at every width tried up to 128 rows (576
/// → 3072: 16 rows 0.70 against 1.40 ms, 64 rows 3.1 against 3.8; 2048 → 12,288: 16 rows 11.8
/// against 23.8 ms, 128 rows 85 against 89), and MKL's f32 GEMM from 2 to 16 rows (2048 → 2048: 4
/// rows 0.51 against 1.10 ms, 16 rows 1.9 against 2.1); on one core of a Sapphire-Rapids-class
/// Xeon without AMX its AVX-512 form beats libtorch's AVX512-BF16 GEMM at 64 rows too
/// (Qwen3-VL-2B's layers: 798–1,017 against 1,025–1,118 ms; -8B's: 1,637–1,869 against
/// 1,942–2,134); past a verify pass's rows (a prefill) libtorch's blocked GEMM keeps the work.
const FEW_ROWS_MAX: i64 = 64;

/// f32 matrices up to this size are kept row by row for the few-row kernel ([`gemm_layout`]):
/// from one row up to 32 MiB it is as fast as MKL's matrix-vector product from the column layout
/// or faster (192 → 1024: 17 against 21 µs; 2048 → 4096: 0.92 against 1.06 ms), and 2-3x faster
/// at 4 rows; above, MKL streams one row from the column layout faster (576 → 49,152: 4.8 against
/// 7.0 ms), so those keep the column layout and MKL.
const FEW_ROWS_F32_MATRIX_BYTES: i64 = 32 << 20;

/// How [`linear`] multiplies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    /// libtorch's own GEMM in the weight's dtype: on a GPU, on a CPU with matrix instructions for a
    /// half-precision dtype, for an f32 matrix kept column by column, and for whatever the
    /// few-row kernel cannot take.
    Libtorch,
    /// [`crate::skinny_gemm`]: a CPU with its instructions, one libtorch thread, at most
    /// [`FEW_ROWS_MAX`] rows, nothing to differentiate, and a row-major weight in bf16 or f16 (on
    /// a CPU without matrix instructions for them) or in f32 ([`gemm_layout`] keeps small ones so).
    FewRows,
    /// The half-precision weight converted to f32 a cache-sized block at a time and multiplied by
    /// MKL ([`in_f32_blocks`]): the other passes of several rows on a CPU without matrix
    /// instructions for the dtype.
    F32Blocks,
}

impl Route {
    fn of(x: &Tensor, weight: &Tensor) -> Self {
        let kind = weight.kind();
        let half_precision = matches!(kind, Kind::BFloat16 | Kind::Half);
        if weight.device() != Device::Cpu || !(kind == Kind::Float || half_precision) {
            return Route::Libtorch;
        }
        if half_precision && cpu_multiplies_few_rows(kind) {
            return Route::Libtorch;
        }
        let rows = x.size().split_last().map_or(1, |(_, lead)| lead.iter().product::<i64>());
        if (1..=FEW_ROWS_MAX).contains(&rows) && few_rows_run(x, weight) {
            Route::FewRows
        } else if half_precision && rows > 1 && !cpu_multiplies(kind) {
            Route::F32Blocks
        } else {
            Route::Libtorch
        }
    }
}

/// Whether [`few_rows`] can take this product: the kernel's instructions, a weight it reads as
/// stored (row-major), nothing that needs a gradient, and one libtorch thread (the kernel runs on
/// the calling thread only, where MKL would use them all).
fn few_rows_run(x: &Tensor, weight: &Tensor) -> bool {
    few_rows_kernel_runs() && weight.is_contiguous() && !weight.requires_grad() && !x.requires_grad()
}

/// The kernel's instructions and one libtorch thread.
fn few_rows_kernel_runs() -> bool {
    skinny_gemm::available() && tch::get_num_threads() == 1
}

/// [`Route::FewRows`]: `x` in f32 (it is a few rows), the product by [`skinny_gemm::multiply`],
/// the bias added in f32 and the output rounded to the weight's dtype, as libtorch's
/// half-precision GEMM rounds its f32 accumulators.
fn few_rows(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Tensor {
    let (n, k) = (weight.size()[0], weight.size()[1]);
    let mut out_shape = x.size();
    *out_shape.last_mut().expect("a linear layer's input has a last dimension") = n;
    let x = x.to_kind(Kind::Float).contiguous().view([-1, k]);
    let m = x.size()[0];
    let out = Tensor::empty([m, n], (Kind::Float, Device::Cpu));
    let [m, k, n] = [m, k, n].map(|d| d as usize);
    // SAFETY: `x` and `out` are contiguous f32 CPU tensors of m·k and m·n elements and `weight` a
    // contiguous CPU tensor of n·k elements of its kind (checked by `Route::of`); `out` is this
    // function's own.
    let (x_values, out_values) = unsafe {
        (
            std::slice::from_raw_parts(x.data_ptr() as *const f32, m * k),
            std::slice::from_raw_parts_mut(out.data_ptr() as *mut f32, m * n),
        )
    };
    let stored = weight.data_ptr();
    // SAFETY: as above; the element type read is the weight's kind (f32 for the rest, which
    // `Route::of` lets through as f32 only).
    let weight_rows = unsafe {
        match weight.kind() {
            Kind::BFloat16 => WeightRows::BFloat16(std::slice::from_raw_parts(stored as *const u16, n * k)),
            Kind::Half => WeightRows::Float16(std::slice::from_raw_parts(stored as *const u16, n * k)),
            _ => WeightRows::Float32(std::slice::from_raw_parts(stored as *const f32, n * k)),
        }
    };
    skinny_gemm::multiply(x_values, weight_rows, [m, k, n], out_values);
    let out = match bias {
        Some(bias) => out + bias.to_kind(Kind::Float),
        None => out,
    };
    out.to_kind(weight.kind()).view(out_shape.as_slice())
}

/// [`Route::F32Blocks`]: `x Wᵀ + b` in f32 from the bf16 or f16 weight, converted a block of
/// output rows at a time so the converted block stays in the core's cache while it is multiplied
/// (converting the whole LM head first made it slower than the bf16 GEMM: 121 against 93 ms),
/// rounded to the weight's dtype. Measured with torch on one core of a Zen 3 EPYC (AVX2 only): 16
/// rows by 576 → 3072 1.4 ms against 5.8 ms in bf16 (64 rows: 3.9 against 23 ms); by 576 → 49,152
/// (SmolLM2's LM head) 26 against 93 ms in bf16 and 26 against 83 ms in f16.
fn in_f32_blocks(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Tensor {
    /// f32 bytes of weight converted at a time (best of 128, 256 and 512 KiB measured).
    const BLOCK_BYTES: i64 = 512 * 1024;
    let (out_dim, in_dim) = (weight.size()[0], weight.size()[1]);
    let block = (BLOCK_BYTES / (in_dim * 4)).max(8);
    let x = x.to_kind(Kind::Float);
    let blocks: Vec<Tensor> = (0..out_dim)
        .step_by(block as usize)
        .map(|start| {
            let len = block.min(out_dim - start);
            let weight_block = weight.narrow(0, start, len).to_kind(Kind::Float);
            let bias = bias.map(|b| b.narrow(0, start, len).to_kind(Kind::Float));
            x.linear(&weight_block, bias.as_ref())
        })
        .collect();
    Tensor::cat(&blocks, -1).to_kind(weight.kind())
}

/// Whether libtorch's GEMM beats the few-row kernel even at a few rows of `kind`: bf16 on a CPU
/// with AMX (Sapphire Rapids and later, with the OS's tile state enabled), whose tiles multiply a
/// 16-row pass for about the cost of a step (1.30 steps for Qwen3-VL-2B's layers); f16 wherever
/// it is multiplied natively ([`cpu_multiplies`]; not measured against the kernel). With
/// AVX512-BF16 alone (Zen 4; a Sapphire Rapids whose VM hides AMX) the kernel is faster: measured
/// on such a Xeon, one core, bf16, Qwen3-VL-2B's layers (4 and the LM head), libtorch's GEMM
/// against the kernel's AVX2 form: a step 125–131 against 89–98 ms, 8 rows 217–233 against
/// 184–191, 16 rows 330–344 against 320–369; its AVX-512 form against the AVX2 one (alternated
/// three times): 16 rows 279–309 against 325–385 ms, 32 rows 445–520 against 604–732.
fn cpu_multiplies_few_rows(kind: Kind) -> bool {
    match kind {
        Kind::BFloat16 => cpu_has_amx_bf16(),
        _ => cpu_multiplies(kind),
    }
}

/// AMX-BF16 in CPUID (leaf 7, EDX bit 22) and its tile state enabled by the OS (XCR0 bits 17 and
/// 18): std's own detection of AMX is not stable yet (rust-lang/rust#126622).
fn cpu_has_amx_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static DETECTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *DETECTED.get_or_init(|| {
            let in_cpu = std::arch::x86_64::__cpuid_count(7, 0).edx >> 22 & 1 == 1;
            in_cpu && std::arch::is_x86_feature_detected!("xsave") && {
                // SAFETY: the CPU has XSAVE (checked), so XGETBV reads XCR0.
                let xcr0 = unsafe { xcr0() };
                xcr0 >> 17 & 0b11 == 0b11
            }
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "xsave")]
unsafe fn xcr0() -> u64 {
    std::arch::x86_64::_xgetbv(0)
}

/// Whether this CPU multiplies `kind` natively, as libtorch's GEMM for it needs to be fast: f32
/// everywhere; bf16 with AVX512-BF16 (Cooper Lake, Sapphire Rapids and later, Zen 4 and later);
/// f16 with AVX512-FP16 (Sapphire Rapids and later). Other architectures are assumed to. Where it
/// does, passes longer than the few-row kernel takes stay with libtorch.
fn cpu_multiplies(kind: Kind) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        match kind {
            Kind::BFloat16 => std::arch::is_x86_feature_detected!("avx512bf16"),
            Kind::Half => std::arch::is_x86_feature_detected!("avx512fp16"),
            _ => true,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = kind;
        true
    }
}

/// `weight` (out, in) as a frozen matrix of [`linear`] is best kept. On a CPU in f32: row by row
/// (as stored) where the few-row kernel will take it (up to [`FEW_ROWS_F32_MATRIX_BYTES`], one
/// libtorch thread), else column by column (its transpose contiguous, the tensor still (out, in)):
/// MKL's sgemm then multiplies the few rows of a step, a verify pass or a draft pass without
/// transposing the matrix into its panels each call. Measured with torch on one core of this
/// project's CPU VM: 16 rows by 192 → 1024, 64 → 43 µs; 16 by 512 → 192, 38 → 22 µs; one row by
/// 192 → 384, 7.6 → 6.0 µs; one row by 2048 → 6144 the same either way. In bf16 (oneDNN or the
/// kernel) and on a GPU the stored layout is as fast or faster, so there the weight stays as it is.
pub fn gemm_layout(weight: Tensor) -> Tensor {
    if weight.device() != Device::Cpu || weight.kind() != Kind::Float || weight.dim() != 2 {
        return weight;
    }
    f32_layout(weight, few_rows_kernel_runs())
}

/// [`gemm_layout`] of an f32 CPU matrix, given whether the few-row kernel runs here.
fn f32_layout(weight: Tensor, few_rows_kernel_runs: bool) -> Tensor {
    if few_rows_kernel_runs && weight.numel() as i64 * 4 <= FEW_ROWS_F32_MATRIX_BYTES {
        weight.contiguous()
    } else {
        weight.tr().contiguous().tr()
    }
}

/// RMSNorm as Qwen computes it: normalize in f32, cast back, then scale. The normalization is
/// libtorch's one fused `rms_norm` (without weight: it upcasts to f32 and casts back exactly as
/// the reference does), then the scale in the model dtype: two calls instead of eight.
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    pub fn load(ckpt: &mut Checkpoint, name: &str, dim: i64, eps: f64) -> Result<Self, WeightsError> {
        Ok(Self { weight: ckpt.take(&format!("{name}.weight"), &[dim])?, eps })
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        &self.weight * normalize_rms(x, self.eps)
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn eps(&self) -> f64 {
        self.eps
    }
}

/// `x / rms(x)` over the last dimension, computed in f32 and cast back to x's dtype.
pub fn normalize_rms(x: &Tensor, eps: f64) -> Tensor {
    let dim = *x.size().last().expect("rms norm input has a last dimension");
    x.rms_norm([dim], None::<Tensor>, eps)
}

/// Several projections of one input (q/k/v, gate/up) as one matmul: their weights are
/// concatenated at load and the output is one (…, Σ out) tensor the caller splits. A trainable
/// checkpoint keeps them apart (its parameters are the stored tensors) and concatenates outputs.
pub struct FusedLinear {
    fused: Option<Linear>,
    parts: Vec<Linear>,
}

impl FusedLinear {
    /// Loads `{prefix}.weight` (out, in) for each (prefix, out) and their biases when `bias`.
    pub fn load(
        ckpt: &mut Checkpoint,
        parts: &[(String, i64)],
        in_dim: i64,
        bias: bool,
    ) -> Result<Self, WeightsError> {
        let parts = parts
            .iter()
            .map(|(prefix, out_dim)| Linear::load_as_stored(ckpt, prefix, in_dim, *out_dim, bias))
            .collect::<Result<Vec<_>, _>>()?;
        if ckpt.is_trainable() {
            return Ok(Self { fused: None, parts });
        }
        let weight = gemm_layout(Tensor::cat(&parts.iter().map(|p| &p.weight).collect::<Vec<_>>(), 0));
        let biases: Option<Vec<&Tensor>> = parts.iter().map(|p| p.bias.as_ref()).collect();
        let bias = biases.map(|b| Tensor::cat(&b, 0));
        Ok(Self { fused: Some(Linear { weight, bias }), parts: Vec::new() })
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        match &self.fused {
            Some(linear) => linear.forward(x),
            None => Tensor::cat(&self.parts.iter().map(|p| p.forward(x)).collect::<Vec<_>>(), -1),
        }
    }
}

/// LayerNorm with weight and bias.
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl LayerNorm {
    pub fn load(ckpt: &mut Checkpoint, name: &str, dim: i64, eps: f64) -> Result<Self, WeightsError> {
        Ok(Self {
            weight: ckpt.take(&format!("{name}.weight"), &[dim])?,
            bias: ckpt.take(&format!("{name}.bias"), &[dim])?,
            eps,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        let dim = *x.size().last().expect("layer norm input has a last dimension");
        x.layer_norm([dim], Some(&self.weight), Some(&self.bias), self.eps, true)
    }
}

/// Activation functions named in Hugging Face configs.
#[derive(Clone, Copy, Debug)]
pub enum Activation {
    Silu,
    Gelu,
    GeluTanh,
}

/// `hidden_act` as config files spell it.
impl<'de> serde::Deserialize<'de> for Activation {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        Self::from_name(&name)
            .ok_or_else(|| serde::de::Error::custom(format!("unsupported hidden_act {name:?}")))
    }
}

impl Activation {
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "silu" | "swish" => Some(Self::Silu),
            "gelu" => Some(Self::Gelu),
            "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => Some(Self::GeluTanh),
            _ => None,
        }
    }

    pub fn apply(self, x: &Tensor) -> Tensor {
        match self {
            Self::Silu => x.silu(),
            Self::Gelu => x.gelu("none"),
            Self::GeluTanh => x.gelu("tanh"),
        }
    }
}

/// SwiGLU MLP `down(act(gate(x)) · up(x))` of the Qwen decoders, the DFlash head and the
/// Qwen2.5-VL vision blocks (the latter with biases); gate and up are one fused matmul.
pub struct SwiGlu {
    gate_up: FusedLinear,
    down_proj: Linear,
    activation: Activation,
    intermediate: i64,
}

impl SwiGlu {
    /// Loads `{prefix}.gate_proj`, `{prefix}.up_proj` and `{prefix}.down_proj`.
    pub fn load(
        ckpt: &mut Checkpoint,
        prefix: &str,
        hidden: i64,
        intermediate: i64,
        bias: bool,
        activation: Activation,
    ) -> Result<Self, WeightsError> {
        let parts =
            [(format!("{prefix}.gate_proj"), intermediate), (format!("{prefix}.up_proj"), intermediate)];
        Ok(Self {
            gate_up: FusedLinear::load(ckpt, &parts, hidden, bias)?,
            down_proj: Linear::load(ckpt, &format!("{prefix}.down_proj"), intermediate, hidden, bias)?,
            activation,
            intermediate,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        let gate_up = self.gate_up.forward(x);
        let gate = self.activation.apply(&gate_up.narrow(-1, 0, self.intermediate));
        self.down_proj.forward(&(gate * gate_up.narrow(-1, self.intermediate, self.intermediate)))
    }
}

/// Inverse rotary frequencies `1 / base^(2i/dim)` for i < dim/2, computed as torch does (f32).
pub fn inverse_frequencies(base: f64, dim: i64, device: tch::Device) -> Tensor {
    let exponents =
        Tensor::arange_start_step(0, dim, 2, (Kind::Int64, device)).to_kind(Kind::Float) / dim as f64;
    Tensor::pow_scalar(base, &exponents).reciprocal()
}

/// Rotates half the last dimension: (x1, x2) → (−x2, x1).
pub fn rotate_half(x: &Tensor) -> Tensor {
    let half = x.size().last().copied().expect("rotary input has a last dimension") / 2;
    let x1 = x.narrow(-1, 0, half);
    let x2 = x.narrow(-1, half, half);
    Tensor::cat(&[x2.neg(), x1], -1)
}

/// `x·cos + rotate_half(x)·sin`, with cos/sin broadcastable to x.
pub fn apply_rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    x * cos + rotate_half(x) * sin
}

/// Rotary tables for `x·cos + rotate_half(x)·sin` in four calls: with the reference's
/// `cos = cat(c, c)`, `sin = cat(s, s)`, `rotate_half(x)·sin = roll(x, half)·cat(−s, s)`, exactly.
pub struct Rotary {
    cos: Tensor,
    signed_sin: Tensor,
}

impl Rotary {
    /// From the angles of the frequency pairs (…, head_dim/2), f32, cast to `kind`.
    pub fn from_half_angles(angles: &Tensor, kind: Kind) -> Self {
        let (cos, sin) = (angles.cos(), angles.sin());
        Self {
            cos: Tensor::cat(&[&cos, &cos], -1).to_kind(kind),
            signed_sin: Tensor::cat(&[&sin.neg(), &sin], -1).to_kind(kind),
        }
    }

    /// The tables of rows `start..start+len` (the first dimension: positions).
    pub fn rows(&self, start: i64, len: i64) -> Self {
        Self { cos: self.cos.narrow(0, start, len), signed_sin: self.signed_sin.narrow(0, start, len) }
    }

    /// Positions the tables cover (their first dimension).
    pub fn len(&self) -> i64 {
        self.cos.size()[0]
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// x (…, head_dim), tables broadcastable to it.
    pub fn apply(&self, x: &Tensor) -> Tensor {
        let half = x.size().last().copied().expect("rotary input has a last dimension") / 2;
        x * &self.cos + x.roll([half], [-1]) * &self.signed_sin
    }
}

/// Additive causal mask (n, past + n) for n new rows after `past` cached ones.
pub fn causal_mask(past: i64, n: i64, kind: Kind, device: tch::Device) -> Tensor {
    let rows = Tensor::arange(n, (Kind::Int64, device)).unsqueeze(1) + past;
    let cols = Tensor::arange(past + n, (Kind::Int64, device)).unsqueeze(0);
    let blocked = cols.gt_tensor(&rows);
    Tensor::zeros([n, past + n], (kind, device)).masked_fill(&blocked, f64::NEG_INFINITY)
}

/// Non-causal attention over independent segments of a packed sequence (vision tower: one
/// segment per image or per window). q, k, v: (heads, N, head_dim); returns (N, heads·head_dim).
pub fn segmented_attention(q: &Tensor, k: &Tensor, v: &Tensor, segments: &[(i64, i64)]) -> Tensor {
    let outputs: Vec<Tensor> = segments
        .iter()
        .map(|&(start, len)| {
            let slice = |t: &Tensor| t.narrow(1, start, len).unsqueeze(0);
            Tensor::scaled_dot_product_attention(
                &slice(q),
                &slice(k),
                &slice(v),
                None::<Tensor>,
                0.0,
                false,
                None,
                false,
            )
            .squeeze_dim(0)
        })
        .collect();
    let out = Tensor::cat(&outputs, 1); // (heads, N, head_dim)
    let heads = out.size()[0];
    let n = out.size()[1];
    out.transpose(0, 1).contiguous().view([n, heads * out.size()[2]])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frozen_f32_cpu_matrix_is_kept_in_the_layout_its_route_multiplies_fastest_from() {
        let weight = Tensor::randn([24, 40], (Kind::Float, Device::Cpu));
        let x = Tensor::randn([3, 16, 40], (Kind::Float, Device::Cpu));
        let plain = x.linear(&weight, None::<Tensor>);
        // Row by row for the few-row kernel, column by column for MKL; the values are the same.
        for (kernel_runs, stride) in [(true, [40, 1]), (false, [1, 24])] {
            let stored = f32_layout(weight.copy(), kernel_runs);
            assert_eq!((stored.size(), stored.stride()), (vec![24, 40], stride.to_vec()));
            assert!(stored.equal(&weight));
            let max_diff = crate::read_f64(&(Linear::from_weight(stored).forward(&x) - &plain).abs().max());
            assert!(max_diff < 1e-5, "{max_diff}");
        }
        // Too large a matrix for the kernel to read faster than MKL keeps the column layout.
        let large =
            Tensor::zeros([(FEW_ROWS_F32_MATRIX_BYTES / 4 / 1024) + 1, 1024], (Kind::Float, Device::Cpu));
        assert_eq!(f32_layout(large, true).stride(), [1, FEW_ROWS_F32_MATRIX_BYTES / 4 / 1024 + 1]);
    }

    #[test]
    fn an_f32_pass_of_few_rows_takes_the_kernel_where_it_runs_and_each_row_is_its_step() {
        let weight = f32_layout(Tensor::randn([300, 67], (Kind::Float, Device::Cpu)), true);
        let bias = Tensor::randn([300], (Kind::Float, Device::Cpu));
        let rows = Tensor::randn([2, 8, 67], (Kind::Float, Device::Cpu));
        let expected = if few_rows_kernel_runs() { Route::FewRows } else { Route::Libtorch };
        assert_eq!(Route::of(&rows, &weight), expected);
        assert_eq!(Route::of(&rows, &f32_layout(weight.copy(), false)), Route::Libtorch);
        if !skinny_gemm::available() {
            return;
        }
        let pass = few_rows(&rows, &weight, Some(&bias));
        let exact = rows.linear(&weight, Some(&bias));
        assert_eq!((pass.kind(), pass.size()), (Kind::Float, vec![2, 8, 300]));
        assert!(crate::read_f64(&(&pass - exact).abs().max()) < 1e-4);
        let step = few_rows(&rows.narrow(1, 3, 1).narrow(0, 1, 1), &weight, Some(&bias));
        assert!(
            step.equal(&pass.narrow(1, 3, 1).narrow(0, 1, 1)),
            "a row is summed alike in a pass and a step"
        );
    }

    #[test]
    fn the_few_row_kernel_sums_as_closely_to_the_exact_product_as_mkl() {
        if !skinny_gemm::available() {
            return;
        }
        // Deterministic values spread over [-1, 1].
        let spread = |n: i64, k: i64, step: f64| {
            (Tensor::arange(n * k, (Kind::Double, Device::Cpu)) * step)
                .sin()
                .view([n, k])
                .to_kind(Kind::Float)
        };
        let (weight, rows) = (spread(512, 2048, 0.7311), spread(16, 2048, 1.913));
        let exact = rows.to_kind(Kind::Double).linear(&weight.to_kind(Kind::Double), None::<Tensor>);
        let error = |y: Tensor| crate::read_f64(&(y.to_kind(Kind::Double) - &exact).abs().max());
        let (kernel, mkl) =
            (error(few_rows(&rows, &weight, None)), error(rows.linear(&weight, None::<Tensor>)));
        println!("max |error| against f64: few-row kernel {kernel:.2e}, MKL {mkl:.2e}");
        assert!(kernel <= 1.5 * mkl, "kernel {kernel:.2e}, MKL {mkl:.2e}");
    }

    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    #[test]
    fn amx_is_found_where_linux_reports_it() {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").expect("/proc/cpuinfo");
        let flags = cpuinfo.lines().find(|line| line.starts_with("flags")).expect("a flags line");
        let reported = flags.split_whitespace().any(|flag| flag == "amx_bf16");
        assert_eq!(cpu_has_amx_bf16(), reported, "CPUID and XCR0 against /proc/cpuinfo");
    }

    #[test]
    fn a_half_precision_pass_on_a_cpu_without_the_dtypes_matrix_instructions_multiplies_in_f32() {
        for kind in [Kind::BFloat16, Kind::Half] {
            // 4,100 outputs of 67 inputs: two blocks of 1,956 and a short one for the f32 blocks,
            // column and input tails for the few-row kernel.
            let f32_weight = Tensor::randn([4100, 67], (Kind::Float, Device::Cpu));
            let weight = f32_weight.to_kind(kind);
            let bias = Tensor::randn([4100], (Kind::Float, Device::Cpu)).to_kind(kind);
            let rows = Tensor::randn([2, 8, 67], (Kind::Float, Device::Cpu)).to_kind(kind);
            let row = rows.narrow(1, 0, 1).narrow(0, 0, 1);
            let expected = if cpu_multiplies_few_rows(kind) {
                Route::Libtorch
            } else if few_rows_run(&rows, &weight) {
                Route::FewRows
            } else if cpu_multiplies(kind) {
                Route::Libtorch
            } else {
                Route::F32Blocks
            };
            assert_eq!(Route::of(&rows, &weight), expected, "{kind:?}");
            let trainable = weight.copy().set_requires_grad(true);
            assert!(!few_rows_run(&rows, &trainable), "a weight that learns is left to libtorch");
            // Beyond rounding (a few units in the last place of 8 bits, for bf16) of `b`.
            let rounding_off = |a: &Tensor, b: &Tensor| {
                let (a, b) = (a.to_kind(Kind::Float), b.to_kind(Kind::Float));
                crate::read_f64(&((a - &b).abs() - b.abs() * 2e-2).max())
            };
            let exact = rows
                .to_kind(Kind::Float)
                .linear(&weight.to_kind(Kind::Float), Some(bias.to_kind(Kind::Float)));
            let mut outputs = vec![
                ("the chosen route", linear(&rows, &weight, Some(&bias))),
                ("f32 blocks", in_f32_blocks(&rows, &weight, Some(&bias))),
            ];
            if skinny_gemm::available() {
                let pass = few_rows(&rows, &weight, Some(&bias));
                // Each row summed alike whatever the rows beside it: the step is the pass's first row.
                let step = few_rows(&row, &weight, Some(&bias));
                assert!(step.equal(&pass.narrow(1, 0, 1).narrow(0, 0, 1)), "{kind:?}");
                outputs.push(("few rows", pass));
            }
            // Every route's output is in the weight's dtype, within rounding of the f32 product.
            for (route, y) in outputs {
                assert_eq!((y.kind(), y.size()), (kind, vec![2, 8, 4100]), "{route}, {kind:?}");
                assert!(rounding_off(&y, &exact) <= 1e-3, "{route}, {kind:?}");
            }
            // And a step, whichever route it takes.
            let first = exact.narrow(1, 0, 1).narrow(0, 0, 1);
            assert!(rounding_off(&linear(&row, &weight, Some(&bias)), &first) <= 1e-3, "{kind:?}");
        }
    }

    #[test]
    fn other_dtypes_keep_the_stored_layout() {
        let weight = Tensor::randn([24, 40], (Kind::BFloat16, Device::Cpu));
        assert_eq!(gemm_layout(weight).stride(), [40, 1]);
    }
}

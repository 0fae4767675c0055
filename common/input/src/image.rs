//! Image side of the Qwen-VL processor: decoding client bytes, `smart_resize`, Pillow-exact bicubic
//! resize, rescale/normalize and the patch layout the vision tower expects. Mirrors transformers'
//! `Qwen2VLImageProcessorPil` (the backend HF uses without torchvision) plus `load_image`, with
//! transparency composited as the processor's `convert_to_rgb` does (or dropped, as `load_image`).

use std::borrow::Cow;
use std::io::Cursor;
use std::path::Path;

use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader, Limits, RgbImage};
use serde::Deserialize;

use super::error::{read_json, read_optional_json, InputError, LoadError};
use super::jpeg::{decode_jpeg, JpegPixels};
use super::resample::{resize_bicubic, resize_bicubic_torchvision};

/// Decoded images larger than this are refused before any pixel is decoded (8192 x 8192). Far above
/// what the processor keeps (`max_pixels`), it only stops decompression bombs.
pub const DEFAULT_MAX_DECODED_PIXELS: u64 = 8192 * 8192;

/// The field name decode/preprocess errors carry until the caller re-anchors them with
/// [`InputError::at_field`].
const IMAGE_FIELD: &str = "image";

/// HF defaults (`Qwen2VLImageProcessorPil` class attributes, OPENAI_CLIP mean/std).
const DEFAULT_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
const DEFAULT_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];
const DEFAULT_MIN_PIXELS: usize = 56 * 56;
const DEFAULT_MAX_PIXELS: usize = 28 * 28 * 1280;
/// PIL's `Image.BICUBIC`; the only resample filter this port implements.
const PIL_BICUBIC: u32 = 3;

/// The image processor settings of a checkpoint (`preprocessor_config.json`), with HF's defaults
/// for whatever the file leaves out.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageProcessorConfig {
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub merge_size: usize,
    /// `size.shortest_edge` in HF terms: the least number of pixels after resizing.
    pub min_pixels: usize,
    /// `size.longest_edge` in HF terms: the most pixels after resizing.
    pub max_pixels: usize,
    pub image_mean: [f64; 3],
    pub image_std: [f64; 3],
    pub rescale_factor: f64,
    pub do_resize: bool,
    pub do_rescale: bool,
    pub do_normalize: bool,
    /// Parsed for completeness; images are always converted to RGB because the vision tower
    /// takes exactly three channels.
    pub do_convert_rgb: bool,
    /// What becomes of transparency: a serving choice (`--image-alpha`), not the checkpoint's.
    pub alpha: Alpha,
    /// Which of transformers' two processors the pixels reproduce: a serving choice too
    /// (`--image-backend`), since transformers picks it by environment, never from the checkpoint.
    pub backend: ImageBackend,
}

/// Which of transformers' two Qwen-VL image processors the pixels reproduce. Both decode and
/// convert to RGB alike (PIL) and lay out patches alike; they differ in the resize and in the
/// rounding of the normalization, enough to change greedy tokens after a few dozen steps.
///
/// transformers 5.x chooses by environment alone: `AutoImageProcessor` builds the torchvision
/// class whenever torchvision is installed (as in every vLLM or SGLang deployment) and the PIL
/// class otherwise, whatever `image_processor_type` the checkpoint names; `backend="pil"` forces
/// the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ImageBackend {
    /// `Qwen2VLImageProcessorPil`: Pillow's bicubic, rescale in f64 then normalize in f32 (numpy).
    Pil,
    /// `Qwen2VLImageProcessor`: torch's antialiased bicubic on uint8 tensors (on CPU, where
    /// transformers processes images by default), rescale folded into the normalization in f32.
    #[default]
    Torchvision,
}

impl ImageBackend {
    /// The name `--image-backend` and ModelInfo use.
    pub fn name(self) -> &'static str {
        match self {
            ImageBackend::Pil => "pil",
            ImageBackend::Torchvision => "torchvision",
        }
    }

    /// The transformers class whose pixels this backend reproduces.
    pub fn processor_class(self) -> &'static str {
        match self {
            ImageBackend::Pil => "Qwen2VLImageProcessorPil",
            ImageBackend::Torchvision => "Qwen2VLImageProcessor",
        }
    }

    /// The backend reproducing transformers class `name`, if either does.
    pub fn of_processor_class(name: &str) -> Option<Self> {
        [ImageBackend::Pil, ImageBackend::Torchvision].into_iter().find(|b| b.processor_class() == name)
    }
}

/// What an image's alpha channel becomes on the way to RGB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alpha {
    /// Composited onto this opaque colour, pixel for pixel as Pillow's `alpha_composite` does:
    /// transformers' image processors (`convert_to_rgb`, white) and vLLM's image loader
    /// (`rgba_background_color`, white by default) both end up here.
    Composite([u8; 3]),
    /// Dropped, keeping the colour channels as they are: transformers' `load_image`
    /// (`convert("RGB")`). Transparent pixels usually carry black, so text on a transparent
    /// background becomes black on black.
    Drop,
}

impl Default for Alpha {
    fn default() -> Self {
        Alpha::Composite([255, 255, 255])
    }
}

impl Default for ImageProcessorConfig {
    fn default() -> Self {
        Self {
            patch_size: 14,
            temporal_patch_size: 2,
            merge_size: 2,
            min_pixels: DEFAULT_MIN_PIXELS,
            max_pixels: DEFAULT_MAX_PIXELS,
            image_mean: DEFAULT_MEAN,
            image_std: DEFAULT_STD,
            rescale_factor: 1.0 / 255.0,
            do_resize: true,
            do_rescale: true,
            do_normalize: true,
            do_convert_rgb: true,
            alpha: Alpha::default(),
            backend: ImageBackend::default(),
        }
    }
}

/// `preprocessor_config.json` as written by either generation of HF: older files carry
/// `min_pixels`/`max_pixels`, newer ones `size: {shortest_edge, longest_edge}`.
#[derive(Deserialize)]
struct RawConfig {
    patch_size: Option<usize>,
    temporal_patch_size: Option<usize>,
    merge_size: Option<usize>,
    min_pixels: Option<usize>,
    max_pixels: Option<usize>,
    size: Option<RawSize>,
    image_mean: Option<PerChannel>,
    image_std: Option<PerChannel>,
    rescale_factor: Option<f64>,
    do_resize: Option<bool>,
    do_rescale: Option<bool>,
    do_normalize: Option<bool>,
    do_convert_rgb: Option<bool>,
    resample: Option<u32>,
}

#[derive(Deserialize)]
struct RawSize {
    shortest_edge: Option<usize>,
    longest_edge: Option<usize>,
    min_pixels: Option<usize>,
    max_pixels: Option<usize>,
}

/// HF accepts a scalar (broadcast to all channels) or one value per channel.
#[derive(Deserialize)]
#[serde(untagged)]
enum PerChannel {
    Scalar(f64),
    List(Vec<f64>),
}

impl PerChannel {
    fn into_rgb(self, name: &str) -> Result<[f64; 3], String> {
        match self {
            Self::Scalar(v) => Ok([v; 3]),
            Self::List(v) => <[f64; 3]>::try_from(v.as_slice())
                .map_err(|_| format!("{name} must have 3 values, got {}", v.len())),
        }
    }
}

impl ImageProcessorConfig {
    /// Reads the settings where HF looks for them: the `image_processor` section of
    /// `processor_config.json`, else `preprocessor_config.json`.
    pub fn from_model_dir(dir: &Path) -> Result<Self, LoadError> {
        let processor_path = dir.join("processor_config.json");
        let nested = read_optional_json(&processor_path)?
            .and_then(|mut json| json.get_mut("image_processor").map(serde_json::Value::take));
        let (path, json) = match nested {
            Some(json) => (processor_path, json),
            None => {
                let path = dir.join("preprocessor_config.json");
                let json = read_json(&path)?;
                (path, json)
            }
        };
        Self::from_json(&json).map_err(|reason| LoadError::InvalidConfig { path, reason })
    }

    /// Builds the config from the parsed JSON of a `preprocessor_config.json`.
    pub fn from_json(json: &serde_json::Value) -> Result<Self, String> {
        let raw = RawConfig::deserialize(json).map_err(|e| e.to_string())?;
        let defaults = Self::default();
        let (min_pixels, max_pixels) = pixel_bounds(&raw, &defaults)?;
        if raw.resample.is_some_and(|r| r != PIL_BICUBIC) {
            return Err(format!("resample {:?} is not supported (only 3 = bicubic)", raw.resample));
        }
        let config = Self {
            patch_size: raw.patch_size.unwrap_or(defaults.patch_size),
            temporal_patch_size: raw.temporal_patch_size.unwrap_or(defaults.temporal_patch_size),
            merge_size: raw.merge_size.unwrap_or(defaults.merge_size),
            min_pixels,
            max_pixels,
            image_mean: raw.image_mean.map_or(Ok(DEFAULT_MEAN), |m| m.into_rgb("image_mean"))?,
            image_std: raw.image_std.map_or(Ok(DEFAULT_STD), |s| s.into_rgb("image_std"))?,
            rescale_factor: raw.rescale_factor.unwrap_or(defaults.rescale_factor),
            do_resize: raw.do_resize.unwrap_or(true),
            do_rescale: raw.do_rescale.unwrap_or(true),
            do_normalize: raw.do_normalize.unwrap_or(true),
            do_convert_rgb: raw.do_convert_rgb.unwrap_or(true),
            alpha: defaults.alpha,
            backend: defaults.backend,
        };
        config.validate()?;
        Ok(config)
    }

    /// Applies server-side overrides of the pixel budget (e.g. `--max-pixels`).
    pub fn with_pixel_bounds(
        mut self,
        min_pixels: Option<usize>,
        max_pixels: Option<usize>,
    ) -> Result<Self, String> {
        self.min_pixels = min_pixels.unwrap_or(self.min_pixels);
        self.max_pixels = max_pixels.unwrap_or(self.max_pixels);
        self.validate()?;
        Ok(self)
    }

    /// Side length, in pixels, that resized images are a multiple of.
    pub fn factor(&self) -> usize {
        self.patch_size * self.merge_size
    }

    /// Length of one row of `pixel_values`.
    pub fn patch_dim(&self) -> usize {
        3 * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    fn validate(&self) -> Result<(), String> {
        let sizes = [
            ("patch_size", self.patch_size),
            ("temporal_patch_size", self.temporal_patch_size),
            ("merge_size", self.merge_size),
            ("max_pixels", self.max_pixels),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{name} must be positive"));
        }
        if self.min_pixels > self.max_pixels {
            return Err(format!("min_pixels ({}) exceeds max_pixels ({})", self.min_pixels, self.max_pixels));
        }
        if self.image_std.contains(&0.0) {
            return Err("image_std must not contain 0".into());
        }
        Ok(())
    }
}

/// HF's precedence: `size` replaces the defaults wholesale, then top-level `min_pixels` /
/// `max_pixels` override its edges.
fn pixel_bounds(raw: &RawConfig, defaults: &ImageProcessorConfig) -> Result<(usize, usize), String> {
    let (mut min, mut max) = match &raw.size {
        None => (Some(defaults.min_pixels), Some(defaults.max_pixels)),
        Some(size) => (size.shortest_edge.or(size.min_pixels), size.longest_edge.or(size.max_pixels)),
    };
    min = raw.min_pixels.or(min);
    max = raw.max_pixels.or(max);
    match (min, max) {
        (Some(min), Some(max)) => Ok((min, max)),
        _ if raw.do_resize == Some(false) => Ok((defaults.min_pixels, defaults.max_pixels)),
        _ => Err("size must contain shortest_edge and longest_edge".into()),
    }
}

/// An image ready for the vision tower.
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedImage {
    /// Row-major `(n_patches, patch_dim)`, in HF's order: rows grouped by 2x2 (merge) blocks,
    /// each row laid out as `(channel, temporal, patch_y, patch_x)`.
    pub pixel_values: Vec<f32>,
    pub n_patches: usize,
    pub patch_dim: usize,
    /// `[t, h, w]` in patches, as `image_grid_thw`.
    pub grid_thw: [usize; 3],
    /// How many `<|image_pad|>` tokens stand for this image in the prompt.
    pub n_tokens: usize,
}

/// Decodes PNG, JPEG or WebP bytes like HF's `load_image` (PIL): EXIF orientation applied, JPEG
/// through libjpeg-turbo's algorithms. An empty `mime_type` means "detect from the bytes".
/// Refuses images over [`DEFAULT_MAX_DECODED_PIXELS`] before decoding them.
pub fn decode_image(data: &[u8], mime_type: &str) -> Result<DynamicImage, InputError> {
    decode_image_with_limit(data, mime_type, DEFAULT_MAX_DECODED_PIXELS)
}

/// [`decode_image`] with a caller-chosen cap on width x height.
pub fn decode_image_with_limit(
    data: &[u8],
    mime_type: &str,
    max_pixels: u64,
) -> Result<DynamicImage, InputError> {
    let format = resolve_format(data, mime_type)?;
    let (width, height) = ImageReader::with_format(Cursor::new(data), format)
        .into_dimensions()
        .map_err(|e| corrupt(data, format, &e))?;
    let pixels = u64::from(width) * u64::from(height);
    if pixels > max_pixels {
        return Err(InputError::TooManyPixels {
            field: IMAGE_FIELD.into(),
            width: width.into(),
            height: height.into(),
            limit: max_pixels,
        });
    }
    if pixels == 0 {
        return Err(InputError::EmptyImage {
            field: IMAGE_FIELD.into(),
            height: height as usize,
            width: width as usize,
        });
    }
    decode_oriented(data, format, width, height)
}

/// Decodes pixels and applies the EXIF orientation, as HF's `load_image` does with
/// `ImageOps.exif_transpose`.
fn decode_oriented(
    data: &[u8],
    format: ImageFormat,
    width: u32,
    height: u32,
) -> Result<DynamicImage, InputError> {
    let mut reader = ImageReader::with_format(Cursor::new(data), format);
    reader.limits(decode_limits(width, height));
    let mut decoder = reader.into_decoder().map_err(|e| corrupt(data, format, &e))?;
    // A malformed EXIF block is not worth failing the request over; PIL ignores it too.
    let orientation = decoder.orientation().unwrap_or(image::metadata::Orientation::NoTransforms);
    let keyed_rgb = is_keyed_rgb(format, decoder.original_color_type());
    let mut img = match format {
        ImageFormat::Jpeg => decode_jpeg_like_pil(data, decoder)?,
        _ => DynamicImage::from_decoder(decoder).map_err(|e| corrupt(data, format, &e))?,
    };
    if keyed_rgb && img.color().has_alpha() {
        // Pillow opens an RGB PNG with a tRNS colour key as mode RGB, which transformers'
        // `convert_to_rgb` passes through untouched; the `image` decoder expands the key to alpha.
        img = DynamicImage::ImageRgb8(to_rgb8(&img));
    }
    img.apply_orientation(orientation);
    Ok(img)
}

/// Whether a decoded image with alpha was an RGB PNG whose transparency is a colour key.
fn is_keyed_rgb(format: ImageFormat, original: image::ExtendedColorType) -> bool {
    format == ImageFormat::Png
        && matches!(original, image::ExtendedColorType::Rgb8 | image::ExtendedColorType::Rgb16)
}

/// libjpeg-exact pixels; CMYK files, which libjpeg cannot convert, go to the `image` decoder.
fn decode_jpeg_like_pil(data: &[u8], fallback: impl ImageDecoder) -> Result<DynamicImage, InputError> {
    let jpeg_error = |reason| InputError::CorruptImage { field: IMAGE_FIELD.into(), format: "JPEG", reason };
    match decode_jpeg(data).map_err(jpeg_error)? {
        JpegPixels::Rgb(rgb) => Ok(DynamicImage::ImageRgb8(rgb)),
        JpegPixels::NotRgb => {
            DynamicImage::from_decoder(fallback).map_err(|e| corrupt(data, ImageFormat::Jpeg, &e))
        }
    }
}

/// Pins the decoder to the dimensions already checked, and its allocations to what such an image
/// needs at 16 bits per channel plus slack.
fn decode_limits(width: u32, height: u32) -> Limits {
    let mut limits = Limits::default();
    limits.max_image_width = Some(width);
    limits.max_image_height = Some(height);
    let pixels = u64::from(width) * u64::from(height);
    limits.max_alloc = Some(pixels * 8 + (64 << 20));
    limits
}

fn resolve_format(data: &[u8], mime_type: &str) -> Result<ImageFormat, InputError> {
    if data.is_empty() {
        return Err(InputError::CorruptImage {
            field: IMAGE_FIELD.into(),
            format: "image",
            reason: "no data".into(),
        });
    }
    // Parameters (`; charset=...`) and case carry no meaning for image types.
    let essence = mime_type.split(';').next().unwrap_or("").trim();
    match essence.to_ascii_lowercase().as_str() {
        "" => sniff_format(data),
        "image/png" => Ok(ImageFormat::Png),
        "image/jpeg" | "image/jpg" | "image/pjpeg" => Ok(ImageFormat::Jpeg),
        "image/webp" => Ok(ImageFormat::WebP),
        _ => Err(InputError::UnsupportedMime { field: IMAGE_FIELD.into(), mime: mime_type.into() }),
    }
}

fn sniff_format(data: &[u8]) -> Result<ImageFormat, InputError> {
    match image::guess_format(data) {
        Ok(f @ (ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP)) => Ok(f),
        Ok(other) => Err(InputError::UnsupportedImageFormat {
            field: IMAGE_FIELD.into(),
            format: format!("{other:?}"),
        }),
        Err(_) => Err(InputError::CorruptImage {
            field: IMAGE_FIELD.into(),
            format: "image",
            reason: "unrecognized data (not PNG, JPEG or WebP)".into(),
        }),
    }
}

fn format_name(format: ImageFormat) -> &'static str {
    match format {
        ImageFormat::Png => "PNG",
        ImageFormat::Jpeg => "JPEG",
        ImageFormat::WebP => "WebP",
        _ => "image",
    }
}

/// A decode failure, with a hint when the bytes are evidently of another format than declared.
fn corrupt(data: &[u8], declared: ImageFormat, err: &image::ImageError) -> InputError {
    if let image::ImageError::Limits(_) = err {
        return InputError::CorruptImage {
            field: IMAGE_FIELD.into(),
            format: format_name(declared),
            reason: format!("exceeds decoder limits: {err}"),
        };
    }
    let hint = match image::guess_format(data) {
        Ok(actual) if actual != declared => format!(" (the bytes look like {actual:?})"),
        _ => String::new(),
    };
    InputError::CorruptImage {
        field: IMAGE_FIELD.into(),
        format: format_name(declared),
        reason: format!("{err}{hint}"),
    }
}

/// Converts to 8-bit RGB like PIL's `convert("RGB")` after `Image.open`: alpha is dropped (HF's
/// `load_image`; [`flatten_alpha`] composites instead, the serving default), and 16-bit samples
/// keep their high byte, as PIL's 16-bit PNG unpackers do.
///
/// Deliberate difference: PIL opens 16-bit grayscale as `I;16` and *clips* it to 0..255 when
/// converting, which whitens nearly every pixel; here it keeps the high byte like the other
/// 16-bit layouts.
pub fn to_rgb8(img: &DynamicImage) -> RgbImage {
    match img {
        DynamicImage::ImageRgb16(_)
        | DynamicImage::ImageRgba16(_)
        | DynamicImage::ImageLuma16(_)
        | DynamicImage::ImageLumaA16(_) => high_byte_rgb(&img.to_rgb16()),
        _ => img.to_rgb8(),
    }
}

/// The image as RGB with its transparency handled by `alpha` (an image without alpha is
/// [`to_rgb8`]). 16-bit images keep the high byte of each channel, alpha included, as Pillow reads
/// 16-bit PNGs.
pub fn flatten_alpha(img: &DynamicImage, alpha: Alpha) -> RgbImage {
    let Alpha::Composite(background) = alpha else {
        return to_rgb8(img);
    };
    if !img.color().has_alpha() {
        return to_rgb8(img);
    }
    let rgba: Vec<u8> = match img {
        DynamicImage::ImageRgba16(_) | DynamicImage::ImageLumaA16(_) => {
            img.to_rgba16().as_raw().iter().map(|&v| (v >> 8) as u8).collect()
        }
        _ => img.to_rgba8().into_raw(),
    };
    let rgb = rgba
        .chunks_exact(4)
        .flat_map(|px| {
            let a = u32::from(px[3]);
            // Over an opaque background Pillow's fixed-point `alpha_composite` equals
            // round((src·a + bg·(255 − a)) / 255), computed as its DIV255.
            std::array::from_fn::<u8, 3, _>(|c| {
                let mixed = u32::from(px[c]) * a + u32::from(background[c]) * (255 - a) + 128;
                (((mixed >> 8) + mixed) >> 8) as u8
            })
        })
        .collect();
    RgbImage::from_raw(img.width(), img.height(), rgb)
        .unwrap_or_else(|| RgbImage::new(img.width(), img.height()))
}

fn high_byte_rgb(img: &image::ImageBuffer<image::Rgb<u16>, Vec<u16>>) -> RgbImage {
    let bytes = img.as_raw().iter().map(|&v| (v >> 8) as u8).collect();
    RgbImage::from_raw(img.width(), img.height(), bytes)
        .unwrap_or_else(|| RgbImage::new(img.width(), img.height()))
}

/// HF's `smart_resize`: the size closest to `height` x `width` whose sides are multiples of
/// `factor` and whose area lies in `[min_pixels, max_pixels]`, keeping the aspect ratio. Uses
/// Python's rounding (`round` is half-to-even).
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: usize,
    max_pixels: usize,
) -> Result<(usize, usize), InputError> {
    if height == 0 || width == 0 || factor == 0 {
        return Err(InputError::EmptyImage { field: IMAGE_FIELD.into(), height, width });
    }
    if height.max(width) as f64 / height.min(width) as f64 > 200.0 {
        return Err(InputError::ExtremeAspectRatio { field: IMAGE_FIELD.into(), height, width });
    }
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    let mut h_bar = (h / f).round_ties_even() as usize * factor;
    let mut w_bar = (w / f).round_ties_even() as usize * factor;
    let area = (height * width) as f64;
    if h_bar * w_bar > max_pixels {
        let beta = (area / max_pixels as f64).sqrt();
        h_bar = factor.max((h / beta / f).floor() as usize * factor);
        w_bar = factor.max((w / beta / f).floor() as usize * factor);
    } else if h_bar * w_bar < min_pixels {
        let beta = (min_pixels as f64 / area).sqrt();
        h_bar = (h * beta / f).ceil() as usize * factor;
        w_bar = (w * beta / f).ceil() as usize * factor;
    }
    Ok((h_bar, w_bar))
}

/// The processor's whole image path: RGB conversion, resize, rescale, normalize, patchify.
pub fn preprocess_image(img: &DynamicImage, cfg: &ImageProcessorConfig) -> Result<PreparedImage, InputError> {
    let rgb = flatten_alpha(img, cfg.alpha);
    let resized = resize_for_model(&rgb, cfg)?;
    patchify(&resized, cfg)
}

/// The 8-bit image exactly as HF has it after its resize step (before rescaling): resized to the
/// `smart_resize` target with the backend's bicubic, or borrowed unchanged when no resize is needed.
pub fn resize_for_model<'a>(
    rgb: &'a RgbImage,
    cfg: &ImageProcessorConfig,
) -> Result<Cow<'a, RgbImage>, InputError> {
    let (height, width) = (rgb.height() as usize, rgb.width() as usize);
    if !cfg.do_resize {
        return Ok(Cow::Borrowed(rgb));
    }
    let (new_h, new_w) = smart_resize(height, width, cfg.factor(), cfg.min_pixels, cfg.max_pixels)?;
    if (new_h, new_w) == (height, width) {
        return Ok(Cow::Borrowed(rgb));
    }
    let (new_w, new_h) = (to_u32(new_w, height, width)?, to_u32(new_h, height, width)?);
    let resize = match cfg.backend {
        ImageBackend::Pil => resize_bicubic,
        ImageBackend::Torchvision => resize_bicubic_torchvision,
    };
    Ok(Cow::Owned(resize(rgb, new_w, new_h)))
}

/// `smart_resize` can only grow an image up to `min_pixels`, so this only trips on absurd configs.
fn to_u32(side: usize, height: usize, width: usize) -> Result<u32, InputError> {
    u32::try_from(side).map_err(|_| InputError::ExtremeAspectRatio {
        field: IMAGE_FIELD.into(),
        height,
        width,
    })
}

/// Rescales, normalizes and lays out an already-resized image as `pixel_values`.
pub fn patchify(rgb: &RgbImage, cfg: &ImageProcessorConfig) -> Result<PreparedImage, InputError> {
    let (height, width) = (rgb.height() as usize, rgb.width() as usize);
    let factor = cfg.factor();
    if height % factor != 0 || width % factor != 0 || height == 0 || width == 0 {
        return Err(InputError::NotPatchAligned { field: IMAGE_FIELD.into(), height, width, factor });
    }
    let (grid_h, grid_w) = (height / cfg.patch_size, width / cfg.patch_size);
    let lut = normalization_table(cfg);
    let n_patches = grid_h * grid_w;
    let mut pixel_values = Vec::with_capacity(n_patches * cfg.patch_dim());
    for (row, col) in patch_order(grid_h, grid_w, cfg.merge_size) {
        push_patch(&mut pixel_values, rgb, &lut, row, col, cfg);
    }
    Ok(PreparedImage {
        pixel_values,
        n_patches,
        patch_dim: cfg.patch_dim(),
        grid_thw: [1, grid_h, grid_w],
        n_tokens: n_patches / (cfg.merge_size * cfg.merge_size),
    })
}

/// Patch (row, col) coordinates in HF's order: merge blocks row-major, and within a block its
/// `merge x merge` patches row-major, so each merged token's patches are contiguous.
fn patch_order(grid_h: usize, grid_w: usize, merge: usize) -> impl Iterator<Item = (usize, usize)> {
    let blocks = (0..grid_h / merge).flat_map(move |bh| (0..grid_w / merge).map(move |bw| (bh, bw)));
    blocks.flat_map(move |(bh, bw)| {
        (0..merge).flat_map(move |mh| (0..merge).map(move |mw| (bh * merge + mh, bw * merge + mw)))
    })
}

/// One patch row: per channel, the `patch x patch` block repeated `temporal_patch_size` times
/// (HF repeats a still image to fill the temporal patch).
fn push_patch(
    out: &mut Vec<f32>,
    rgb: &RgbImage,
    lut: &[[f32; 256]; 3],
    row: usize,
    col: usize,
    cfg: &ImageProcessorConfig,
) {
    let p = cfg.patch_size;
    let raw = rgb.as_raw();
    let stride = rgb.width() as usize * 3;
    for (c, table) in lut.iter().enumerate() {
        let start = out.len();
        for y in row * p..(row + 1) * p {
            let line = &raw[y * stride..(y + 1) * stride];
            out.extend((col * p..(col + 1) * p).map(|x| table[usize::from(line[x * 3 + c])]));
        }
        for _ in 1..cfg.temporal_patch_size {
            out.extend_from_within(start..start + p * p);
        }
    }
}

/// The normalized value of every 8-bit level per channel, with each backend's exact dtypes.
fn normalization_table(cfg: &ImageProcessorConfig) -> [[f32; 256]; 3] {
    let mut lut = [[0f32; 256]; 3];
    for (c, table) in lut.iter_mut().enumerate() {
        for (level, slot) in table.iter_mut().enumerate() {
            *slot = match cfg.backend {
                ImageBackend::Pil => numpy_normalized(level as u8, c, cfg),
                ImageBackend::Torchvision => torch_normalized(level as u8, c, cfg),
            };
        }
    }
    lut
}

/// `np_rescale` (f64, then cast to f32) followed by `np_normalize` (f32).
fn numpy_normalized(level: u8, channel: usize, cfg: &ImageProcessorConfig) -> f32 {
    let mut v = f32::from(level);
    if cfg.do_rescale {
        v = (f64::from(level) * cfg.rescale_factor) as f32;
    }
    if cfg.do_normalize {
        v = (v - cfg.image_mean[channel] as f32) / cfg.image_std[channel] as f32;
    }
    v
}

/// The torchvision backend's `rescale_and_normalize`: with both steps on, the rescale is folded
/// into f32 mean and std (`tensor(mean) * (1 / rescale_factor)`, the factor cast to f32 as torch
/// does a Python scalar) and the level normalized with them; else one of the two alone, in f32.
fn torch_normalized(level: u8, channel: usize, cfg: &ImageProcessorConfig) -> f32 {
    let (mean, std) = (cfg.image_mean[channel] as f32, cfg.image_std[channel] as f32);
    let v = f32::from(level);
    match (cfg.do_rescale, cfg.do_normalize) {
        (true, true) => {
            let inverse = (1.0 / cfg.rescale_factor) as f32;
            (v - mean * inverse) / (std * inverse)
        }
        (false, true) => (v - mean) / std,
        (true, false) => v * cfg.rescale_factor as f32,
        (false, false) => v,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_matches_python() {
        // Expected values computed with transformers' smart_resize.
        assert_eq!(smart_resize(224, 224, 28, 3136, 1003520).unwrap(), (224, 224));
        // round(42/28 = 1.5) is 2 under half-to-even, round(70/28 = 2.5) is 2.
        assert_eq!(smart_resize(42, 70, 28, 3136, 1003520).unwrap(), (56, 56));
        // Too small: scaled up with ceil.
        assert_eq!(smart_resize(10, 20, 28, 3136, 1003520).unwrap(), (56, 84));
        // Too large: scaled down with floor.
        assert_eq!(smart_resize(4000, 3000, 28, 3136, 1003520).unwrap(), (1148, 840));
    }

    #[test]
    fn smart_resize_refuses_extreme_aspect_ratio() {
        let err = smart_resize(1, 201, 28, 3136, 1003520).unwrap_err();
        assert!(matches!(err, InputError::ExtremeAspectRatio { .. }));
        assert!(smart_resize(1, 200, 28, 3136, 1003520).is_ok());
    }

    #[test]
    fn config_accepts_both_spellings_of_the_pixel_bounds() {
        let old = serde_json::json!({"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14});
        let new = serde_json::json!({"size": {"shortest_edge": 65536, "longest_edge": 16777216},
                                     "patch_size": 16, "image_mean": [0.5, 0.5, 0.5], "image_std": 0.5});
        let old = ImageProcessorConfig::from_json(&old).unwrap();
        let new = ImageProcessorConfig::from_json(&new).unwrap();
        assert_eq!((old.min_pixels, old.max_pixels), (3136, 12845056));
        assert_eq!((new.min_pixels, new.max_pixels, new.patch_size), (65536, 16777216, 16));
        assert_eq!(new.image_std, [0.5; 3]);
        assert_eq!(old.image_mean, DEFAULT_MEAN);
    }

    #[test]
    fn patch_rows_follow_hf_layout() {
        // 2x2 patches of size 1, merge 2, temporal 2: one merge block, rows in (y, x) order,
        // each row (channel, temporal).
        let cfg = ImageProcessorConfig {
            patch_size: 1,
            do_rescale: false,
            do_normalize: false,
            ..Default::default()
        };
        let img = RgbImage::from_fn(2, 2, |x, y| image::Rgb([(10 * y + x) as u8, 100, 200]));
        let out = patchify(&img, &cfg).unwrap();
        assert_eq!(out.grid_thw, [1, 2, 2]);
        assert_eq!(out.patch_dim, 6);
        let expected: Vec<f32> =
            [0., 1., 10., 11.].iter().flat_map(|&v| [v, v, 100., 100., 200., 200.]).collect();
        assert_eq!(out.pixel_values, expected);
    }

    #[test]
    fn unknown_mime_is_refused() {
        let err = decode_image(b"GIF89a", "image/gif").unwrap_err();
        assert!(matches!(err, InputError::UnsupportedMime { .. }));
        let err = decode_image(b"not an image", "").unwrap_err();
        assert!(matches!(err, InputError::CorruptImage { .. }));
    }
}

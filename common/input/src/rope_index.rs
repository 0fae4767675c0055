//! Qwen-VL's multimodal rotary positions (M-RoPE), as transformers' `get_rope_index` computes them
//! for images: text advances one position per token on all three axes; an image's tokens get
//! (temporal, row, column) grid coordinates offset by the position where the image starts, and
//! the text after it resumes at that start + max(rows, columns).

use super::error::InputError;

/// Positions of a token sequence on the three M-RoPE axes, each of the sequence's length.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MropePositions {
    pub t: Vec<i64>,
    pub h: Vec<i64>,
    pub w: Vec<i64>,
}

impl MropePositions {
    pub fn len(&self) -> usize {
        self.t.len()
    }

    pub fn is_empty(&self) -> bool {
        self.t.is_empty()
    }

    /// Row-major `(3, n)` layout, ready for a `[3, 1, n]` position-id tensor.
    pub fn to_flat(&self) -> Vec<i64> {
        [&self.t, &self.h, &self.w].into_iter().flatten().copied().collect()
    }

    /// Plain text of `len` tokens: 0, 1, 2… on every axis (a text-only model reads the first).
    pub fn text(len: usize) -> Self {
        let mut positions = Self::default();
        (0..len as i64).for_each(|position| positions.push_text(position));
        positions
    }

    fn push_text(&mut self, position: i64) {
        self.t.push(position);
        self.h.push(position);
        self.w.push(position);
    }

    fn max(&self) -> Option<i64> {
        [&self.t, &self.h, &self.w].into_iter().flat_map(|axis| axis.iter().copied()).max()
    }
}

/// Computes M-RoPE positions for a prompt and its `rope_delta` (max position + 1 - length), which
/// later tokens use: see [`decode_positions`].
///
/// Each maximal run of `image_token_id` is one image, matched in order with `image_grids`
/// (`[t, h, w]` in patches). Beyond HF, this checks that the runs and grids agree and that every
/// run directly follows `vision_start_token_id`, because a mismatch would silently misplace image
/// features in the model.
pub fn mrope_position_ids(
    input_ids: &[u32],
    image_grids: &[[usize; 3]],
    spatial_merge_size: usize,
    image_token_id: u32,
    vision_start_token_id: u32,
) -> Result<(MropePositions, i64), InputError> {
    let mut positions = MropePositions::default();
    let mut grids = image_grids.iter().enumerate();
    let mut next_position: i64 = 0;
    let mut index = 0;
    while index < input_ids.len() {
        if input_ids[index] != image_token_id {
            positions.push_text(next_position);
            next_position += 1;
            index += 1;
            continue;
        }
        let run = run_length(&input_ids[index..], image_token_id);
        if index == 0 || input_ids[index - 1] != vision_start_token_id {
            return Err(layout_error(format!("image tokens at {index} do not follow a vision-start token")));
        }
        let (image, grid) = grids.next().ok_or_else(|| {
            layout_error(format!("more image token runs than the {} images", image_grids.len()))
        })?;
        let llm_grid = llm_grid(grid, spatial_merge_size, image)?;
        check_run(run, llm_grid, image)?;
        push_image(&mut positions, llm_grid, next_position);
        next_position += llm_grid[1].max(llm_grid[2]) as i64;
        index += run;
    }
    if let Some((image, _)) = grids.next() {
        return Err(layout_error(format!("image {image} has no image tokens")));
    }
    let delta = positions.max().map_or(0, |max| max + 1 - input_ids.len() as i64);
    Ok((positions, delta))
}

/// Positions of the generated tokens at sequence indices `start..start + count`: plain 1-D
/// positions shifted by the prompt's `rope_delta`, the same on all three axes.
pub fn decode_positions(start: usize, count: usize, rope_delta: i64) -> MropePositions {
    let mut positions = MropePositions::default();
    for index in start..start + count {
        positions.push_text(decode_position(index, rope_delta));
    }
    positions
}

/// The position of the token at sequence index `index` after the prompt.
pub fn decode_position(index: usize, rope_delta: i64) -> i64 {
    index as i64 + rope_delta
}

fn run_length(ids: &[u32], token: u32) -> usize {
    ids.iter().take_while(|&&id| id == token).count()
}

fn layout_error(reason: String) -> InputError {
    InputError::ImageTokenLayout { reason }
}

/// The grid in LLM tokens: spatial sides divided by the merge size.
fn llm_grid(grid: &[usize; 3], merge: usize, image: usize) -> Result<[usize; 3], InputError> {
    let [t, h, w] = *grid;
    if merge == 0 || t == 0 || h == 0 || w == 0 || h % merge != 0 || w % merge != 0 {
        return Err(layout_error(format!(
            "image {image} grid {grid:?} is not divisible by merge size {merge}"
        )));
    }
    Ok([t, h / merge, w / merge])
}

fn check_run(run: usize, llm_grid: [usize; 3], image: usize) -> Result<(), InputError> {
    let expected = llm_grid.iter().product::<usize>();
    if run != expected {
        return Err(layout_error(format!(
            "image {image} has {run} image tokens but its grid needs {expected}"
        )));
    }
    Ok(())
}

/// HF's `get_vision_position_ids` for a still image (time interval 1), in (t, h, w) row-major
/// order.
fn push_image(positions: &mut MropePositions, [t, h, w]: [usize; 3], start: i64) {
    for ti in 0..t as i64 {
        for hi in 0..h as i64 {
            for wi in 0..w as i64 {
                positions.t.push(start + ti);
                positions.h.push(start + hi);
                positions.w.push(start + wi);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IMG: u32 = 9;
    const START: u32 = 8;

    #[test]
    fn text_only_is_one_dimensional() {
        let (pos, delta) = mrope_position_ids(&[1, 2, 3], &[], 2, IMG, START).unwrap();
        assert_eq!(pos.t, vec![0, 1, 2]);
        assert_eq!(pos.h, pos.t);
        assert_eq!(delta, 0);
    }

    #[test]
    fn image_block_uses_grid_coordinates() {
        // grid 1x4x6 patches -> 2x3 tokens after a 2x2 merge.
        let ids = [1, START, IMG, IMG, IMG, IMG, IMG, IMG, 7, 5];
        let (pos, delta) = mrope_position_ids(&ids, &[[1, 4, 6]], 2, IMG, START).unwrap();
        assert_eq!(pos.t, vec![0, 1, 2, 2, 2, 2, 2, 2, 5, 6]);
        assert_eq!(pos.h, vec![0, 1, 2, 2, 2, 3, 3, 3, 5, 6]);
        assert_eq!(pos.w, vec![0, 1, 2, 3, 4, 2, 3, 4, 5, 6]);
        assert_eq!(delta, 7 - 10);
        assert_eq!(decode_position(10, delta), 7);
        assert_eq!(decode_positions(10, 2, delta).w, vec![7, 8]);
    }

    #[test]
    fn mismatched_grids_are_errors() {
        let ids = [START, IMG, IMG];
        assert!(mrope_position_ids(&ids, &[[1, 4, 4]], 2, IMG, START).is_err());
        assert!(mrope_position_ids(&ids, &[], 2, IMG, START).is_err());
        assert!(mrope_position_ids(&[1], &[[1, 2, 2]], 2, IMG, START).is_err());
        assert!(mrope_position_ids(&[IMG], &[[1, 2, 2]], 2, IMG, START).is_err());
    }
}

//! A preallocated key/value cache: batch 1 for serving (one generation per engine), a batch of
//! sequences that advance together for batched greedy decoding (training data regeneration).
//!
//! One buffer (layers, 2, batch, kv_heads, capacity, head_dim) holds every layer's K and V; the
//! first `len` rows are live. Appending writes in place, truncating only moves `len`, and
//! [`KvCache::keep_rows`] compacts a verified tree to its committed path in place with one gather
//! over all layers, so no step reallocates.

use tch::{Device, Kind, Tensor};

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("KV cache full: {needed} positions needed, capacity {capacity}")]
    Full { needed: usize, capacity: usize },
    #[error("invalid cache rows: {0}")]
    BadRows(String),
}

pub struct KvCache {
    /// (layers, 2, batch, kv_heads, capacity, head_dim): K at [l, 0], V at [l, 1]. `None` in a
    /// training cache, whose layers are separate tensors.
    buffer: Option<Tensor>,
    /// (batch, kv_heads, capacity, head_dim) per layer: views of `buffer`, or tensors of their own.
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    len: usize,
    capacity: usize,
}

/// The position axis of a layer's (batch, kv_heads, capacity, head_dim) K or V.
const POSITION_AXIS: i64 = 2;

impl KvCache {
    /// A batch-1 cache.
    pub fn new(
        layers: usize,
        kv_heads: i64,
        head_dim: i64,
        capacity: usize,
        kind: Kind,
        device: Device,
    ) -> Self {
        Self::batched(layers, 1, kv_heads, head_dim, capacity, kind, device)
    }

    /// A cache for `batch` sequences that advance together (left-padded to one length).
    pub fn batched(
        layers: usize,
        batch: usize,
        kv_heads: i64,
        head_dim: i64,
        capacity: usize,
        kind: Kind,
        device: Device,
    ) -> Self {
        // Uninitialized: only rows already written are ever read (every view is `[..len]`), and a
        // drafter session's cache is sized for its whole context limit (tens of MB), whose
        // zero-fill would cost every request several milliseconds.
        let shape = [layers as i64, 2, batch as i64, kv_heads, capacity as i64, head_dim];
        let buffer = Tensor::empty(shape, (kind, device));
        let view = |layer: usize, which: i64| buffer.select(0, layer as i64).select(0, which);
        Self {
            keys: (0..layers).map(|l| view(l, 0)).collect(),
            values: (0..layers).map(|l| view(l, 1)).collect(),
            buffer: Some(buffer),
            len: 0,
            capacity,
        }
    }

    /// A cache for a pass with gradients: one tensor per layer's K and V. Autograd versions a
    /// tensor's storage as a whole, so in one shared buffer the write of a later layer would
    /// invalidate the K/V an earlier layer's attention saved for its backward.
    pub fn for_training(
        layers: usize,
        kv_heads: i64,
        head_dim: i64,
        capacity: usize,
        kind: Kind,
        device: Device,
    ) -> Self {
        let alloc = || Tensor::empty([1, kv_heads, capacity as i64, head_dim], (kind, device));
        Self {
            keys: (0..layers).map(|_| alloc()).collect(),
            values: (0..layers).map(|_| alloc()).collect(),
            buffer: None,
            len: 0,
            capacity,
        }
    }

    /// Live positions.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Sequences held (1 unless [`KvCache::batched`]).
    pub fn batch(&self) -> usize {
        self.keys.first().map_or(1, |k| k.size()[0] as usize)
    }

    /// Fails before a forward pass that would not fit, so nothing is half-applied.
    pub fn ensure_room(&self, new_rows: usize) -> Result<(), CacheError> {
        let needed = self.len + new_rows;
        if needed > self.capacity {
            return Err(CacheError::Full { needed, capacity: self.capacity });
        }
        Ok(())
    }

    /// Writes `n` new rows of layer `layer` of a batch-1 cache at `len..len+n` and returns the
    /// live K and V including them, each (kv_heads, len+n, head_dim). `k`, `v`: (kv_heads, n,
    /// head_dim). The cache length itself advances once per forward pass, in [`KvCache::advance`].
    pub fn write(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> (Tensor, Tensor) {
        let (keys, values) = self.write_batch(layer, &k.unsqueeze(0), &v.unsqueeze(0));
        (keys.squeeze_dim(0), values.squeeze_dim(0))
    }

    /// [`KvCache::write`] for every sequence of the batch: `k`, `v` (batch, kv_heads, n,
    /// head_dim); returns (batch, kv_heads, len+n, head_dim) each.
    pub fn write_batch(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> (Tensor, Tensor) {
        let n = k.size()[2];
        let start = self.len as i64;
        self.keys[layer].narrow(POSITION_AXIS, start, n).copy_(k);
        self.values[layer].narrow(POSITION_AXIS, start, n).copy_(v);
        let live = |t: &Tensor| t.narrow(POSITION_AXIS, 0, start + n);
        (live(&self.keys[layer]), live(&self.values[layer]))
    }

    /// Places batch-1 `source`'s live rows as sequence `sequence` of this batched cache at
    /// `offset..offset + source.len()`, zeroing the columns before them (left padding, which the
    /// caller masks out: zeros, unlike uninitialized memory, cannot turn a masked score into NaN).
    /// The cache length becomes `offset + source.len()`, which every sequence must share.
    pub fn splice_sequence(
        &mut self,
        sequence: usize,
        source: &KvCache,
        offset: usize,
    ) -> Result<(), CacheError> {
        let end = offset + source.len();
        if end > self.capacity || sequence >= self.batch() || source.batch() != 1 {
            return Err(CacheError::BadRows(format!(
                "sequence {sequence} at {offset}..{end} in a batch of {} with capacity {}",
                self.batch(),
                self.capacity
            )));
        }
        let (b, offset, rows) = (sequence as i64, offset as i64, source.len() as i64);
        for (mine, theirs) in self.keys.iter().zip(&source.keys).chain(self.values.iter().zip(&source.values))
        {
            let slot = mine.select(0, b);
            let _ = slot.narrow(POSITION_AXIS - 1, 0, offset).zero_();
            slot.narrow(POSITION_AXIS - 1, offset, rows).copy_(&theirs.select(0, 0).narrow(
                POSITION_AXIS - 1,
                0,
                rows,
            ));
        }
        self.len = end;
        Ok(())
    }

    /// Commits the rows written by the last forward pass.
    pub fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// Drops every position from `new_len` on.
    pub fn truncate(&mut self, new_len: usize) {
        self.len = self.len.min(new_len);
    }

    /// Keeps, of the rows from `start` on, only `keep` (offsets relative to `start`, strictly
    /// increasing), moved down to `start..start+keep.len()` in order; then the cache ends there.
    /// This is the compaction of a verified tree to its committed path.
    pub fn keep_rows(&mut self, start: usize, keep: &[usize]) -> Result<(), CacheError> {
        let tail = self
            .len
            .checked_sub(start)
            .ok_or_else(|| CacheError::BadRows(format!("start {start} beyond cache length {}", self.len)))?;
        if keep.windows(2).any(|w| w[0] >= w[1]) || keep.last().is_some_and(|&k| k >= tail) {
            return Err(CacheError::BadRows(format!("rows {keep:?} not increasing within 0..{tail}")));
        }
        let is_prefix = keep.iter().enumerate().all(|(i, &k)| i == k);
        if !is_prefix {
            let index: Vec<i64> = keep.iter().map(|&k| (start + k) as i64).collect();
            let index = crate::upload(&index, self.keys[0].device());
            let (start, rows) = (start as i64, keep.len() as i64);
            // index_select copies first, so overlapping source and destination are safe.
            let compact = |buffer: &Tensor, axis: i64| {
                let moved = buffer.index_select(axis, &index);
                buffer.narrow(axis, start, rows).copy_(&moved);
            };
            match &self.buffer {
                Some(stacked) => compact(stacked, POSITION_AXIS + 2),
                None => self.keys.iter().chain(&self.values).for_each(|b| compact(b, POSITION_AXIS)),
            }
        }
        self.len = start + keep.len();
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // tests build and read host tensors freely
mod tests {
    use super::*;

    fn rows(cache: &KvCache, layer: usize) -> Vec<f32> {
        let live = cache.keys[layer].narrow(POSITION_AXIS, 0, cache.len() as i64);
        Vec::<f32>::try_from(live.select(0, 0).select(0, 0).select(1, 0).contiguous()).unwrap()
    }

    fn append(cache: &mut KvCache, values: &[f32]) {
        let n = values.len() as i64;
        let k = Tensor::from_slice(values).view([1, n, 1]).expand([2, n, 3], false).contiguous();
        for layer in 0..2 {
            let _ = cache.write(layer, &k, &k);
        }
        cache.advance(values.len());
    }

    #[test]
    fn append_truncate_and_keep_rows() {
        // The stacked buffer and the training layout (a tensor per layer) behave alike.
        for stacked in [true, false] {
            let mut cache = if stacked {
                KvCache::new(2, 2, 3, 16, Kind::Float, Device::Cpu)
            } else {
                KvCache::for_training(2, 2, 3, 16, Kind::Float, Device::Cpu)
            };
            append(&mut cache, &[0., 1., 2.]);
            append(&mut cache, &[10., 11., 12., 13., 14.]);
            assert_eq!(rows(&cache, 1), vec![0., 1., 2., 10., 11., 12., 13., 14.]);
            cache.keep_rows(3, &[0, 2, 4]).unwrap();
            assert_eq!(rows(&cache, 0), vec![0., 1., 2., 10., 12., 14.]);
            assert_eq!(rows(&cache, 1), vec![0., 1., 2., 10., 12., 14.]);
            cache.truncate(4);
            assert_eq!(rows(&cache, 0), vec![0., 1., 2., 10.]);
            assert!(cache.keep_rows(2, &[1, 0]).is_err());
            assert!(cache.ensure_room(13).is_err());
            assert!(cache.ensure_room(12).is_ok());
        }
    }
}

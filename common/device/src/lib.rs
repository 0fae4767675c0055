//! glance-device: where tensors cross between the host and the device. The per-round code of both
//! services moves data only through these functions: host data goes up with [`upload`] /
//! [`upload_tensor`] (pinned memory, non-blocking on a GPU: no host sync), device data comes down
//! without a sync with [`stage_to_host`] (pinned memory, readable after the next read-back), and
//! results come back with [`read_back`] (a host sync on a GPU: it waits for every kernel and copy
//! queued before). Each call is counted per thread ([`crossings`]), so a test on the CPU can assert
//! how many syncs a round takes on a GPU (on the CPU itself the calls cost nothing and move nothing).
//! The crates whose code runs on a model's device link this crate's `clippy.toml` as theirs: it
//! bans making tensors from host data, or reading values off tensors, any other way.

use std::cell::Cell;

use tch::kind::Element;
use tch::{Device, Tensor};

thread_local! {
    static UPLOADS: Cell<u64> = const { Cell::new(0) };
    static READ_BACKS: Cell<u64> = const { Cell::new(0) };
    static STAGED: Cell<u64> = const { Cell::new(0) };
}

/// Crossings made by this thread since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Crossings {
    /// Host → device copies (not host syncs).
    pub uploads: u64,
    /// Device → host copies that wait (each a host sync on a GPU).
    pub read_backs: u64,
    /// Device → host copies that do not wait (see [`stage_to_host`]; not host syncs).
    pub staged: u64,
}

impl std::ops::Add for Crossings {
    type Output = Crossings;

    fn add(self, more: Crossings) -> Crossings {
        Crossings {
            uploads: self.uploads + more.uploads,
            read_backs: self.read_backs + more.read_backs,
            staged: self.staged + more.staged,
        }
    }
}

impl std::ops::Sub for Crossings {
    type Output = Crossings;

    fn sub(self, earlier: Crossings) -> Crossings {
        Crossings {
            uploads: self.uploads - earlier.uploads,
            read_backs: self.read_backs - earlier.read_backs,
            staged: self.staged - earlier.staged,
        }
    }
}

/// This thread's crossings so far; the difference of two readings is what ran in between.
pub fn crossings() -> Crossings {
    Crossings {
        uploads: UPLOADS.with(Cell::get),
        read_backs: READ_BACKS.with(Cell::get),
        staged: STAGED.with(Cell::get),
    }
}

fn count(counter: &'static std::thread::LocalKey<Cell<u64>>) {
    counter.with(|c| c.set(c.get() + 1));
}

/// Small host data (token ids, positions, row indices, masks) as a tensor on `device`, without a
/// host sync (see [`upload_tensor`]).
pub fn upload<T: Element>(values: &[T], device: Device) -> Tensor {
    upload_tensor(&host_tensor(values), device)
}

/// Host data as a tensor that stays on the host (a checkpoint being written, a host-side index):
/// no crossing. The serving crates' clippy rule (`common/device/clippy.toml`) bans
/// `Tensor::from_slice` there, so every tensor made from host data says where it lives: here, or
/// on the device through [`upload`].
#[allow(clippy::disallowed_methods)] // the one place host data becomes a tensor
pub fn host_tensor<T: Element>(values: &[T]) -> Tensor {
    Tensor::from_slice(values)
}

/// One value of `tensor` (its first element), read back: a host sync when it is on a GPU,
/// counted as one.
#[allow(clippy::disallowed_methods)] // on the host after the counted read-back
pub fn read_f64(tensor: &Tensor) -> f64 {
    read_back(&tensor.flatten(0, -1).narrow(0, 0, 1)).double_value(&[0])
}

/// One integer value of `tensor` (its first element), read back as [`read_f64`] does.
#[allow(clippy::disallowed_methods)] // on the host after the counted read-back
pub fn read_i64(tensor: &Tensor) -> i64 {
    read_back(&tensor.flatten(0, -1).narrow(0, 0, 1)).int64_value(&[0])
}

/// A CPU tensor copied to `device`. On a GPU the copy goes through pinned memory without blocking,
/// so it is not a host sync: the stream orders it before the kernels that read it (a plain
/// `to_device` from pageable memory waits for the copy, and with it for every kernel queued before).
/// A tensor already on a device is not host data: it moves there directly, and nothing is counted.
pub fn upload_tensor(host: &Tensor, device: Device) -> Tensor {
    if host.device() != Device::Cpu {
        return host.to_device(device);
    }
    count(&UPLOADS);
    match device {
        Device::Cpu => host.shallow_clone(),
        _ => host.pin_memory(device).to_device_(device, host.kind(), true, false),
    }
}

/// `tensor` on the host: a view when it is there already, else a copy that waits for the device
/// (a host sync).
pub fn read_back(tensor: &Tensor) -> Tensor {
    count(&READ_BACKS);
    tensor.to_device(Device::Cpu)
}

/// A host copy of `tensor` that does not wait: on a GPU the copy is queued on the stream into
/// pinned memory (libtorch pins the destination of a non-blocking device-to-host copy), so its
/// contents may be read only after the next [`read_back`] on this thread, whose sync covers every
/// copy queued before it. That lets one pass's results come down with a single host sync: stage
/// the bulky outputs first, then read back the small one that decides what to keep of them. On the
/// CPU it is a view.
pub fn stage_to_host(tensor: &Tensor) -> Tensor {
    count(&STAGED);
    match tensor.device() {
        Device::Cpu => tensor.shallow_clone(),
        _ => tensor.to_device_(Device::Cpu, tensor.kind(), true, false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crossings_are_counted_per_thread() {
        let before = crossings();
        let up = upload(&[1, 2, 3], Device::Cpu);
        let _ = read_back(&up);
        let _ = read_back(&up);
        let staged = stage_to_host(&up);
        assert!(staged.equal(&up));
        assert_eq!(crossings() - before, Crossings { uploads: 1, read_backs: 2, staged: 1 });
        let other = std::thread::spawn(|| {
            let _ = upload(&[1], Device::Cpu);
            crossings()
        });
        assert_eq!(other.join().unwrap(), Crossings { uploads: 1, read_backs: 0, staged: 0 });
        assert_eq!(
            crossings() - before,
            Crossings { uploads: 1, read_backs: 2, staged: 1 },
            "not this thread's"
        );
    }
}

//! How many bytes of a load's reads the tier keeps in flight: a window that
//! adapts to the device.
//!
//! A fixed window is wrong somewhere: on a VM's virtio disk 32 MiB of reads in
//! flight left bandwidth unused that 256 MiB found (2.43 vs 2.59 GiB/s at 4K
//! tokens of llama3-8b), while on a device that saturates early a large window
//! only makes reads land together at a layer's end, to be hashed after it. So
//! the window starts at `TierConfig::load_inflight_bytes` and doubles while the
//! layers read with the larger window arrive measurably faster (by more than
//! [`GAIN`]), steps back to the last size that paid once one does not, and
//! probes again after a while (the device, or the load on it, may change). The
//! first layer is not governed by it: it has its own small cap so it lands early.
//!
//! Pure: it sees (bytes, nanoseconds) per finished layer and answers a size;
//! the tier feeds it (`Tier::issue_one` reads it, a layer's announcement
//! reports to it).

/// The speed-up a doubled window must show to be kept: below it the
/// difference is noise on these devices and a smaller window lands reads
/// sooner.
pub const GAIN: f64 = 1.03;

/// Bytes read at one window size before its bandwidth is judged: a few
/// windows' worth, so one slow or fast layer does not decide.
const SAMPLE_WINDOWS: u64 = 4;

/// Windows' worth of bytes read at a settled size before probing again.
const REPROBE_WINDOWS: u64 = 256;

/// The adaptive in-flight window of a tier's loads.
#[derive(Clone, Debug)]
pub struct RestoreWindow {
    bytes: u64,
    min: u64,
    max: u64,
    /// Bytes and nanoseconds read at the current size since it was set.
    sample_bytes: u64,
    sample_nanos: u64,
    /// The size before this one and its bandwidth (bytes per nanosecond),
    /// while probing upwards.
    previous: Option<(u64, f64)>,
    /// Bytes left at a settled size before the next probe; None while probing.
    settled_for: Option<u64>,
}

impl RestoreWindow {
    /// A window starting at `start` bytes, never above `max` (a `max` at or
    /// below `start` keeps it fixed at `start`).
    pub fn new(start: u64, max: u64) -> RestoreWindow {
        let start = start.max(1);
        RestoreWindow {
            bytes: start,
            min: start,
            max: max.max(start),
            sample_bytes: 0,
            sample_nanos: 0,
            previous: None,
            settled_for: if max <= start { Some(u64::MAX) } else { None },
        }
    }

    /// Bytes of a load's reads (past its first layer) to keep in flight now.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// A layer of `bytes` finished `nanos` after the layer before it of the
    /// same load (its reads ran with the current window).
    pub fn observe(&mut self, bytes: u64, nanos: u64) {
        if bytes == 0 || nanos == 0 {
            return;
        }
        if let Some(left) = self.settled_for.as_mut() {
            if *left == u64::MAX {
                return; // fixed
            }
            *left = left.saturating_sub(bytes);
            if *left == 0 {
                // Probe again from here: measure this size first.
                self.settled_for = None;
                self.previous = None;
                self.restart_sample();
            }
            return;
        }
        self.sample_bytes += bytes;
        self.sample_nanos += nanos;
        if self.sample_bytes < SAMPLE_WINDOWS * self.bytes {
            return;
        }
        let bw = self.sample_bytes as f64 / self.sample_nanos as f64;
        match self.previous {
            Some((size, prev)) if bw <= prev * GAIN => {
                // Doubling did not pay: back to the size that did.
                self.bytes = size;
                self.settle();
            }
            _ if self.bytes >= self.max => self.settle(),
            _ => {
                self.previous = Some((self.bytes, bw));
                self.bytes = (self.bytes * 2).min(self.max);
                self.restart_sample();
            }
        }
    }

    fn settle(&mut self) {
        self.previous = None;
        self.settled_for = Some(REPROBE_WINDOWS * self.bytes);
        self.restart_sample();
    }

    fn restart_sample(&mut self) {
        self.sample_bytes = 0;
        self.sample_nanos = 0;
    }

    /// The smallest size the window takes (where it started).
    pub fn min(&self) -> u64 {
        self.min
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// Feeds layers of `layer` bytes read at a device speed that depends on
    /// the window (bytes per ns), until `bytes` were read.
    fn run(w: &mut RestoreWindow, layer: u64, bytes: u64, speed: impl Fn(u64) -> f64) {
        let mut read = 0;
        while read < bytes {
            let ns = (layer as f64 / speed(w.bytes())) as u64;
            w.observe(layer, ns);
            read += layer;
        }
    }

    #[test]
    fn grows_while_bandwidth_grows_and_stops_at_the_knee() {
        // Saturates at 128 MiB: 1.0, 1.5, 2.0, then flat.
        let speed = |b: u64| match b {
            b if b <= 32 * MIB => 1.0,
            b if b <= 64 * MIB => 1.5,
            _ => 2.0,
        };
        let mut w = RestoreWindow::new(32 * MIB, 1024 * MIB);
        run(&mut w, 16 * MIB, 4096 * MIB, speed);
        assert_eq!(w.bytes(), 128 * MIB, "{w:?}");
    }

    #[test]
    fn a_device_that_is_saturated_already_keeps_the_start() {
        let mut w = RestoreWindow::new(32 * MIB, 256 * MIB);
        run(&mut w, 16 * MIB, 2048 * MIB, |_| 2.0);
        assert_eq!(w.bytes(), 32 * MIB);
        // Noise below GAIN does not move it either.
        let mut w = RestoreWindow::new(32 * MIB, 256 * MIB);
        run(&mut w, 16 * MIB, 2048 * MIB, |b| {
            if b > 32 * MIB {
                2.04
            } else {
                2.0
            }
        });
        assert_eq!(w.bytes(), 32 * MIB);
    }

    #[test]
    fn never_passes_its_cap_and_a_cap_at_the_start_is_fixed() {
        let mut w = RestoreWindow::new(32 * MIB, 100 * MIB);
        run(&mut w, 16 * MIB, 8192 * MIB, |b| b as f64 / MIB as f64);
        assert_eq!(w.bytes(), 100 * MIB);
        let mut w = RestoreWindow::new(32 * MIB, 32 * MIB);
        run(&mut w, 16 * MIB, 8192 * MIB, |b| b as f64 / MIB as f64);
        assert_eq!(w.bytes(), 32 * MIB);
        assert_eq!(w.min(), 32 * MIB);
    }

    #[test]
    fn probes_again_when_the_device_gets_faster_with_more_in_flight() {
        let mut w = RestoreWindow::new(32 * MIB, 512 * MIB);
        run(&mut w, 16 * MIB, 2048 * MIB, |_| 1.0);
        assert_eq!(w.bytes(), 32 * MIB);
        // Another tenant left: now depth pays up to 256 MiB.
        run(&mut w, 16 * MIB, 64 * 1024 * MIB, |b| {
            (b.min(256 * MIB) as f64 / (32 * MIB) as f64).sqrt()
        });
        assert_eq!(w.bytes(), 256 * MIB, "{w:?}");
    }

    #[test]
    fn zero_sized_or_instant_layers_are_ignored() {
        let mut w = RestoreWindow::new(32 * MIB, 256 * MIB);
        for _ in 0..1000 {
            w.observe(0, 5);
            w.observe(16 * MIB, 0);
        }
        assert_eq!(w.bytes(), 32 * MIB);
    }
}

//! Green contexts: the I/O kernels get a fixed partition of the SMs, the
//! compute (the engine's attention and MLP kernels) the rest, so I/O never
//! steals more SMs than the slack table budgets for it.
//!
//! Sequence (CUDA driver API 12.4+): `cuDeviceGetDevResource(SM)` →
//! `cuDevSmResourceSplitByCount` (one group of the I/O SMs + the remainder) →
//! `cuDevResourceGenerateDesc` per part → `cuGreenCtxCreate(...,
//! CU_GREEN_CTX_DEFAULT_STREAM)` → `cuCtxFromGreenCtx` → streams with
//! `cuGreenCtxStreamCreate`. The green contexts are ours (not cudarc's
//! `CudaContext`, whose drop would `cuCtxDestroy` a context the green context
//! owns); they are destroyed with `cuGreenCtxDestroy` after every stream and
//! module made in them (see `context`).
//!
//! Granularity. A split group must hold at least `min` SMs and a multiple of
//! `align`. CUDA 13.0 reports both in the SM resource (`minSmPartitionSize`,
//! `smCoscheduledAlignment`); where a driver reports 0 kvtier falls back to
//! the table in the driver API documentation of
//! `cuDevSmResourceSplitByCount`: compute capability 6.x: 1/1, 7.x: 2/2,
//! 8.x: 4/2, 9.0 and newer (Hopper): 8/8.

use super::context::{Context, Device};
use super::driver;
use crate::error::{Error, Result};

/// Minimum and step of an SM group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SmGranularity {
    /// Fewest SMs in a group.
    pub min: u32,
    /// Group sizes are multiples of this.
    pub align: u32,
}

impl SmGranularity {
    /// The documented granularity for compute capability `major`.
    pub fn for_compute_capability(major: i32) -> SmGranularity {
        let (min, align) = match major {
            ..=6 => (1, 1),
            7 => (2, 2),
            8 => (4, 2),
            _ => (8, 8),
        };
        SmGranularity { min, align }
    }

    /// The driver's numbers where it reports them, the table otherwise.
    pub fn from_resource(reported_min: u32, reported_align: u32, cc_major: i32) -> SmGranularity {
        let t = Self::for_compute_capability(cc_major);
        SmGranularity {
            min: if reported_min > 0 {
                reported_min
            } else {
                t.min
            },
            align: if reported_align > 0 {
                reported_align
            } else {
                t.align
            },
        }
    }
}

/// How `total` SMs divide into an I/O and a compute partition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitPlan {
    /// SMs of the device.
    pub total: u32,
    /// SMs of the I/O partition.
    pub io: u32,
    /// SMs of the compute partition.
    pub compute: u32,
    /// The device's SM granularity.
    pub granularity: SmGranularity,
}

impl SplitPlan {
    /// Check that `io` SMs can be split off `total` with granularity `g` and
    /// that the remainder is a usable compute partition. Errors name valid
    /// choices.
    pub fn new(total: u32, io: u32, g: SmGranularity) -> Result<SplitPlan> {
        let bad = |why: String| {
            Error::gpu(
                format!("SM split of {io} I/O SMs out of {total}"),
                format!(
                    "{why}; on this GPU an I/O partition is at least {} SMs and a multiple of {} (e.g. {})",
                    g.min,
                    g.align,
                    Self::choices(total, g)
                ),
            )
        };
        if io == 0 {
            return Err(bad("the I/O partition must have SMs".into()));
        }
        if io < g.min {
            return Err(bad(format!(
                "{io} is below the minimum group size {}",
                g.min
            )));
        }
        if io % g.align != 0 {
            return Err(bad(format!("{io} is not a multiple of {}", g.align)));
        }
        if io >= total || total - io < g.min {
            return Err(bad(format!(
                "that leaves {} SMs for compute, fewer than {}",
                total.saturating_sub(io),
                g.min
            )));
        }
        Ok(SplitPlan {
            total,
            io,
            compute: total - io,
            granularity: g,
        })
    }

    /// A few valid I/O sizes, for error messages.
    fn choices(total: u32, g: SmGranularity) -> String {
        let first = g.min.next_multiple_of(g.align);
        let v: Vec<String> = (0..4)
            .map(|i| first + i * g.align)
            .filter(|&n| n < total && total - n >= g.min)
            .map(|n| n.to_string())
            .collect();
        if v.is_empty() {
            format!("none: {total} SMs cannot be split in two")
        } else {
            v.join(", ")
        }
    }
}

/// One green context: a context whose kernels run on `sm_count` SMs only.
/// Derefs to its [`Context`] (streams, modules, memory).
#[derive(Clone, Debug)]
pub struct GreenContext {
    ctx: Context,
    sm_count: u32,
}

impl std::ops::Deref for GreenContext {
    type Target = Context;
    fn deref(&self) -> &Context {
        &self.ctx
    }
}

impl GreenContext {
    fn create(device: &Device, resource: &driver::CUdevResource) -> Result<GreenContext> {
        let desc = driver::resource_desc(resource)?;
        let g = driver::green_ctx_create(desc, device.raw())?;
        let ctx = Context::from_green(device, g)?;
        // The driver's own count (after any rounding it did).
        let sm_count = driver::sm_fields(&driver::green_ctx_sm_resource(g)?).0;
        Ok(GreenContext { ctx, sm_count })
    }

    /// SMs the driver gave the partition.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// The green context, for streams and launches.
    pub fn context(&self) -> &Context {
        &self.ctx
    }
}

/// The I/O and compute partitions of one device.
#[derive(Debug)]
pub struct SmPartition {
    /// The I/O partition.
    pub io: GreenContext,
    /// The compute partition.
    pub compute: GreenContext,
    /// How the SMs were divided.
    pub plan: SplitPlan,
}

impl SmPartition {
    /// Split `device` into `io_sms` SMs for the I/O kernels and the rest for
    /// compute. Fails with a clear error when green contexts are unsupported
    /// or the split is impossible (see [`SplitPlan::new`]).
    pub fn split(device: &Device, io_sms: u32) -> Result<SmPartition> {
        let missing = driver::missing_green_symbols()?;
        let (cc, _) = device.compute_capability()?;
        let (ok, why) = super::probe::green_support(driver::version()?, cc, &missing);
        if !ok {
            return Err(Error::gpu(
                format!("green contexts on device {}", device.ordinal()),
                why,
            ));
        }
        let all = driver::device_sm_resource(device.raw())?;
        let (total, min, align) = driver::sm_fields(&all);
        let plan = SplitPlan::new(total, io_sms, SmGranularity::from_resource(min, align, cc))?;
        let (group, rest) = driver::sm_split_one(&all, plan.io)?;
        let (got, _, _) = driver::sm_fields(&group);
        let (left, _, _) = driver::sm_fields(&rest);
        if got != plan.io {
            return Err(Error::gpu(
                format!("SM split of {} I/O SMs out of {total}", plan.io),
                format!("the driver made a group of {got} SMs (remainder {left}); choose an I/O size the driver accepts exactly"),
            ));
        }
        let io = GreenContext::create(device, &group)?;
        let compute = GreenContext::create(device, &rest)?;
        Ok(SmPartition {
            io,
            compute,
            plan: SplitPlan {
                compute: left,
                ..plan
            },
        })
    }

    /// The two green contexts, I/O first.
    pub fn into_parts(self) -> (GreenContext, GreenContext) {
        (self.io, self.compute)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOPPER: SmGranularity = SmGranularity { min: 8, align: 8 };

    #[test]
    fn hopper_splits() {
        // H100 SXM: 132 SMs.
        let p = SplitPlan::new(132, 16, HOPPER).unwrap();
        assert_eq!((p.io, p.compute), (16, 116));
        let p = SplitPlan::new(132, 8, HOPPER).unwrap();
        assert_eq!(p.compute, 124);
        // 120 leaves 12: still a partition (the remainder need not be a multiple of 8).
        assert_eq!(SplitPlan::new(132, 120, HOPPER).unwrap().compute, 12);
        // A 128-SM part: 120 leaves exactly the minimum of 8.
        assert_eq!(SplitPlan::new(128, 120, HOPPER).unwrap().compute, 8);
    }

    #[test]
    fn impossible_splits_say_why_and_what_works() {
        let e = SplitPlan::new(132, 12, HOPPER).unwrap_err().to_string();
        assert!(e.contains("12 is not a multiple of 8"), "{e}");
        assert!(e.contains("e.g. 8, 16, 24, 32"), "{e}");
        let e = SplitPlan::new(132, 4, HOPPER).unwrap_err().to_string();
        assert!(e.contains("below the minimum group size 8"), "{e}");
        let e = SplitPlan::new(132, 0, HOPPER).unwrap_err().to_string();
        assert!(e.contains("must have SMs"), "{e}");
        let e = SplitPlan::new(132, 128, HOPPER).unwrap_err().to_string();
        assert!(e.contains("leaves 4 SMs for compute, fewer than 8"), "{e}");
        let e = SplitPlan::new(132, 136, HOPPER).unwrap_err().to_string();
        assert!(e.contains("leaves 0 SMs"), "{e}");
        let e = SplitPlan::new(12, 8, HOPPER).unwrap_err().to_string();
        assert!(e.contains("none: 12 SMs cannot be split in two"), "{e}");
    }

    #[test]
    fn granularity_prefers_the_driver_and_falls_back_to_the_table() {
        assert_eq!(
            SmGranularity::for_compute_capability(9),
            SmGranularity { min: 8, align: 8 }
        );
        assert_eq!(
            SmGranularity::for_compute_capability(8),
            SmGranularity { min: 4, align: 2 }
        );
        assert_eq!(
            SmGranularity::for_compute_capability(7),
            SmGranularity { min: 2, align: 2 }
        );
        assert_eq!(SmGranularity::for_compute_capability(10).min, 8);
        assert_eq!(
            SmGranularity::from_resource(0, 0, 9),
            SmGranularity { min: 8, align: 8 }
        );
        assert_eq!(
            SmGranularity::from_resource(16, 8, 9),
            SmGranularity { min: 16, align: 8 }
        );
        // Ampere with 2-SM steps: 6 is fine there, not on Hopper.
        assert!(SplitPlan::new(108, 6, SmGranularity::for_compute_capability(8)).is_ok());
        assert!(SplitPlan::new(132, 6, HOPPER).is_err());
    }
}

//! Every raw CUDA driver call kvtier makes, in one place.
//!
//! Loading. cudarc's own loader (`sys::culib()`) panics when libcuda is missing
//! or lacks any of the ~500 symbols of the CUDA 13.0 header, and it searches for
//! `libcuda.so` (the development symlink), which driver-only installs do not
//! have. So kvtier loads the driver itself, in steps that each end in a
//! [`Error::Gpu`] naming the thing and the fix instead of a panic:
//!
//! 1. `dlopen("libcuda.so.1")` (the name the NVIDIA driver installs);
//! 2. `dlsym("cuDriverGetVersion")` and call it: a library without it is not a
//!    CUDA driver, and a driver older than 13.0 lacks symbols of the bindings;
//! 3. `dlsym` of every symbol in `REQUIRED` (and `GREEN`, reported apart);
//! 4. only then cudarc's `sys::Lib::new("libcuda.so.1")` — our own instance of
//!    cudarc's raw function table, not its global one — inside `catch_unwind`
//!    as a last guard; then `cuInit(0)`.
//!
//! Every function below goes through that table (`driver()?.lib.cuX`). The
//! handles (`CUcontext`, `CUstream`, ...) are raw pointers; the RAII types that
//! own them live in `context`, `green`, `memory` and `dma`, which call only the
//! functions here. Functions whose soundness depends on host memory the caller
//! owns (registration, copies to raw addresses, launches, stream memory ops)
//! are `unsafe fn` with the contract in their doc; the rest are safe because a
//! wrong handle only makes the driver return an error.

use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::ffi::{c_int, c_uint, c_void, CStr, CString};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::OnceLock;

pub use sys::{CUcontext, CUdevice, CUdeviceptr, CUevent, CUfunction, CUmodule, CUstream};
pub use sys::{CUdevResource, CUdevResourceDesc, CUgreenCtx};

/// The library name the NVIDIA driver installs (the unversioned `libcuda.so`
/// comes only with the toolkit's development files).
pub const LIBCUDA: &CStr = c"libcuda.so.1";

/// The oldest driver API the bindings (cudarc, `cuda-13000`) can load:
/// cudarc resolves every symbol of the 13.0 header at load time.
pub(crate) const MIN_DRIVER_API: i32 = 13000;

/// Symbols kvtier calls; all must be present before cudarc's table is built.
pub(crate) const REQUIRED: &[&CStr] = &[
    c"cuDriverGetVersion",
    c"cuInit",
    c"cuGetErrorName",
    c"cuGetErrorString",
    c"cuDeviceGetCount",
    c"cuDeviceGet",
    c"cuDeviceGetName",
    c"cuDeviceGetAttribute",
    c"cuDeviceTotalMem_v2",
    c"cuDeviceGetPCIBusId",
    c"cuDevicePrimaryCtxRetain",
    c"cuDevicePrimaryCtxRelease_v2",
    c"cuCtxSetCurrent",
    c"cuCtxSynchronize",
    c"cuModuleLoadData",
    c"cuModuleUnload",
    c"cuModuleGetFunction",
    c"cuFuncLoad",
    c"cuLaunchKernel",
    c"cuStreamCreate",
    c"cuStreamDestroy_v2",
    c"cuStreamSynchronize",
    c"cuStreamQuery",
    c"cuEventCreate",
    c"cuEventRecord",
    c"cuEventSynchronize",
    c"cuEventElapsedTime_v2",
    c"cuEventDestroy_v2",
    c"cuMemAlloc_v2",
    c"cuMemFree_v2",
    c"cuMemAllocHost_v2",
    c"cuMemFreeHost",
    c"cuMemHostRegister_v2",
    c"cuMemHostUnregister",
    c"cuMemHostGetDevicePointer_v2",
    c"cuMemcpyHtoD_v2",
    c"cuMemcpyDtoH_v2",
    c"cuMemcpyAsync",
    c"cuMemsetD8_v2",
    c"cuStreamWaitValue32_v2",
    c"cuStreamWriteValue32_v2",
    c"cuStreamWaitEvent",
    c"cuMemGetHandleForAddressRange",
    c"cuPointerGetAttribute",
];

/// Green-context symbols (driver API 12.4+). Checked and reported apart so
/// that `probe` can say which one is missing.
pub(crate) const GREEN: &[&CStr] = &[
    c"cuDeviceGetDevResource",
    c"cuDevSmResourceSplitByCount",
    c"cuDevResourceGenerateDesc",
    c"cuGreenCtxCreate",
    c"cuCtxFromGreenCtx",
    c"cuGreenCtxStreamCreate",
    c"cuGreenCtxGetDevResource",
    c"cuGreenCtxDestroy",
];

pub(crate) struct Driver {
    lib: sys::Lib,
    pub version: i32,
    pub missing_green: Vec<&'static str>,
}

// SAFETY: the table holds plain function pointers into libcuda; the CUDA
// driver API is thread-safe.
unsafe impl Send for Driver {}
// SAFETY: as above; the table is never mutated after loading.
unsafe impl Sync for Driver {}

/// The step of loading the driver that failed (module doc), so a report can say more than
/// "unusable": an old driver's version, a library that is not libcuda, a failed `cuInit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum LoadStage {
    /// `dlopen` found no library of that name.
    NotFound,
    /// The library has no `cuDriverGetVersion`: not a CUDA driver.
    NotCuda,
    /// `cuDriverGetVersion` failed.
    VersionQuery,
    /// The driver API is older than `MIN_DRIVER_API`.
    TooOld,
    /// Symbols of `REQUIRED` are missing.
    MissingSymbols,
    /// cudarc's table could not be built from the library.
    Bindings,
    /// `cuInit` failed.
    Init,
}

/// Why the driver cannot be used: the step, the driver version when it was read, and a
/// message that names the thing and the fix.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadError {
    /// The loading step that failed.
    pub stage: LoadStage,
    /// The driver API version, when it was read.
    pub version: Option<i32>,
    /// What failed and the fix.
    pub reason: String,
}

impl LoadError {
    fn new(stage: LoadStage, version: Option<i32>, reason: String) -> LoadError {
        LoadError {
            stage,
            version,
            reason,
        }
    }
}

static DRIVER: OnceLock<std::result::Result<Driver, LoadError>> = OnceLock::new();

fn gpu_err(what: impl Into<String>, reason: impl Into<String>) -> Error {
    Error::Gpu {
        what: what.into(),
        reason: reason.into(),
        code: None,
    }
}

/// The loaded driver, loading it on first use. Never panics.
pub(crate) fn driver() -> Result<&'static Driver> {
    DRIVER
        .get_or_init(|| load(LIBCUDA))
        .as_ref()
        .map_err(|e| gpu_err("CUDA driver", e.reason.clone()))
}

/// Why the driver (loaded once, on first use) cannot be used; `None` when it can.
pub(crate) fn load_error() -> Option<LoadError> {
    DRIVER.get_or_init(|| load(LIBCUDA)).as_ref().err().cloned()
}

fn dlerror() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the
    // next dl* call on this thread; it is copied at once.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "no error text".into()
    } else {
        // SAFETY: non-null and NUL-terminated (above).
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

/// Steps 1–3 of the module doc against library `name`: returns the driver
/// version and the missing green-context symbols, or why the library cannot
/// be used. Separate from [`load`] so tests can point it at libraries that
/// are absent or are not CUDA drivers.
pub(crate) fn preflight(name: &CStr) -> std::result::Result<(i32, Vec<&'static str>), LoadError> {
    let lib = name.to_string_lossy();
    // SAFETY: a valid NUL-terminated name. The handle is never closed: libcuda
    // must stay mapped while any context may exist (one mapping leaked).
    let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() {
        return Err(LoadError::new(
            LoadStage::NotFound, None,
            format!(
            "no CUDA driver: {lib} not found ({}); install the NVIDIA driver (580 or newer, CUDA 13.0) or run on a machine with an NVIDIA GPU",
            dlerror()
        ),
        ));
    }
    let has = |s: &CStr| {
        // SAFETY: a live handle from dlopen and a NUL-terminated symbol name.
        !unsafe { libc::dlsym(h, s.as_ptr()) }.is_null()
    };
    // SAFETY: as in `has`.
    let get_version = unsafe { libc::dlsym(h, c"cuDriverGetVersion".as_ptr()) };
    if get_version.is_null() {
        return Err(LoadError::new(
            LoadStage::NotCuda, None,
            format!(
            "{lib} is not a CUDA driver library: it has no cuDriverGetVersion; check that libcuda.so.1 on the loader path is the NVIDIA driver's"
        ),
        ));
    }
    type GetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;
    // SAFETY: cuDriverGetVersion's C signature is CUresult(int*); CUresult is an int.
    let get_version: GetVersion = unsafe { std::mem::transmute(get_version) };
    let mut v: c_int = 0;
    // SAFETY: writes one int; documented as callable before cuInit.
    let rc = unsafe { get_version(&mut v) };
    if rc != 0 {
        return Err(LoadError::new(
            LoadStage::VersionQuery, None,
            format!("cuDriverGetVersion in {lib} failed with CUresult {rc}; the driver installation is broken: reinstall the NVIDIA driver"),
        ));
    }
    if v < MIN_DRIVER_API {
        return Err(LoadError::new(
            LoadStage::TooOld, Some(v),
            format!(
            "CUDA driver API {}.{} in {lib} is older than {}.{}, the version kvtier's CUDA bindings need; update the NVIDIA driver to 580 or newer",
            v / 1000,
            (v % 1000) / 10,
            MIN_DRIVER_API / 1000,
            (MIN_DRIVER_API % 1000) / 10
        ),
        ));
    }
    let missing: Vec<&str> = REQUIRED
        .iter()
        .filter(|s| !has(s))
        .map(|s| s.to_str().unwrap_or("?"))
        .collect();
    if !missing.is_empty() {
        return Err(LoadError::new(
            LoadStage::MissingSymbols,
            Some(v),
            format!(
                "{lib} (driver API {v}) lacks {}; update the NVIDIA driver",
                missing.join(", ")
            ),
        ));
    }
    let missing_green = GREEN
        .iter()
        .filter(|s| !has(s))
        .map(|s| s.to_str().unwrap_or("?"))
        .collect();
    Ok((v, missing_green))
}

fn load(name: &CStr) -> std::result::Result<Driver, LoadError> {
    let (version, missing_green) = preflight(name)?;
    let path = name.to_string_lossy().into_owned();
    // cudarc's table resolves every 13.0 symbol and panics on a missing one;
    // the preflight above makes that unreachable for a 13.0+ driver, and
    // catch_unwind turns a surprise into an error rather than an abort.
    let lib = std::panic::catch_unwind(|| {
        // SAFETY: loads the library the preflight accepted; library
        // initialisers of libcuda are safe to run.
        unsafe { sys::Lib::new(&path) }.map_err(|e| e.to_string())
    })
    .map_err(|_| {
        format!("cudarc could not resolve a CUDA 13.0 symbol in {path}; update the NVIDIA driver")
    })
    .and_then(|r| r.map_err(|e| format!("loading {path}: {e}")))
    .map_err(|e| LoadError::new(LoadStage::Bindings, Some(version), e))?;
    let d = Driver {
        lib,
        version,
        missing_green,
    };
    // SAFETY: cuInit(0) is the documented first call; idempotent.
    let rc = unsafe { (d.lib.cuInit)(0) };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Err(LoadError::new(
            LoadStage::Init,
            Some(version),
            format!(
                "cuInit failed: {} (is the nvidia kernel module loaded and /dev/nvidia* accessible?)",
                d.describe(rc)
            ),
        ));
    }
    Ok(d)
}

impl Driver {
    fn describe(&self, rc: sys::CUresult) -> String {
        let mut name: *const std::ffi::c_char = std::ptr::null();
        let mut text: *const std::ffi::c_char = std::ptr::null();
        // SAFETY: both write a pointer to a static NUL-terminated string or
        // leave it untouched on an unknown code.
        unsafe {
            (self.lib.cuGetErrorName)(rc, &mut name);
            (self.lib.cuGetErrorString)(rc, &mut text);
        }
        let s = |p: *const std::ffi::c_char| {
            (!p.is_null()).then(|| {
                // SAFETY: non-null static string owned by libcuda.
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            })
        };
        match (s(name), s(text)) {
            (Some(n), Some(t)) => format!("{n} ({t})"),
            (Some(n), None) => n,
            _ => format!("CUresult {}", rc as u32),
        }
    }
}

/// Turn a CUresult into `Ok` or an `Error::Gpu` naming the call.
fn check(d: &Driver, rc: sys::CUresult, what: impl FnOnce() -> String) -> Result<()> {
    if rc == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Gpu {
            what: what(),
            reason: d.describe(rc),
            code: Some(rc as u32),
        })
    }
}

/// The numeric CUresult of `CUDA_ERROR_NOT_READY` (a query whose work is pending).
pub const CUDA_ERROR_NOT_READY: u32 = sys::CUresult::CUDA_ERROR_NOT_READY as u32;

// ---------------------------------------------------------------------------
// Devices
// ---------------------------------------------------------------------------

pub(crate) fn version() -> Result<i32> {
    Ok(driver()?.version)
}

pub(crate) fn missing_green_symbols() -> Result<Vec<&'static str>> {
    Ok(driver()?.missing_green.clone())
}

pub(crate) fn device_count() -> Result<i32> {
    let d = driver()?;
    let mut n: c_int = 0;
    // SAFETY: writes one int.
    check(d, unsafe { (d.lib.cuDeviceGetCount)(&mut n) }, || {
        "cuDeviceGetCount".into()
    })?;
    Ok(n)
}

pub(crate) fn device_get(ordinal: i32) -> Result<CUdevice> {
    let d = driver()?;
    let mut dev: CUdevice = 0;
    // SAFETY: writes one CUdevice; an out-of-range ordinal is an error code.
    check(d, unsafe { (d.lib.cuDeviceGet)(&mut dev, ordinal) }, || {
        format!("cuDeviceGet({ordinal})")
    })?;
    Ok(dev)
}

pub(crate) fn device_name(dev: CUdevice) -> Result<String> {
    let d = driver()?;
    let mut buf = [0 as std::ffi::c_char; 256];
    // SAFETY: the buffer holds `len` bytes; the driver NUL-terminates within it.
    check(
        d,
        unsafe { (d.lib.cuDeviceGetName)(buf.as_mut_ptr(), buf.len() as c_int, dev) },
        || "cuDeviceGetName".into(),
    )?;
    buf[255] = 0;
    // SAFETY: NUL-terminated (last byte forced above).
    Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

pub(crate) fn device_attr(dev: CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
    let d = driver()?;
    let mut v: c_int = 0;
    // SAFETY: writes one int.
    check(
        d,
        unsafe { (d.lib.cuDeviceGetAttribute)(&mut v, attr, dev) },
        || format!("cuDeviceGetAttribute({attr:?})"),
    )?;
    Ok(v)
}

pub(crate) fn device_total_mem(dev: CUdevice) -> Result<u64> {
    let d = driver()?;
    let mut v: usize = 0;
    // SAFETY: writes one size_t.
    check(
        d,
        unsafe { (d.lib.cuDeviceTotalMem_v2)(&mut v, dev) },
        || "cuDeviceTotalMem".into(),
    )?;
    Ok(v as u64)
}

pub(crate) fn device_pci_bus_id(dev: CUdevice) -> Result<String> {
    let d = driver()?;
    let mut buf = [0 as std::ffi::c_char; 64];
    // SAFETY: the buffer holds `len` bytes; the driver NUL-terminates within it.
    check(
        d,
        unsafe { (d.lib.cuDeviceGetPCIBusId)(buf.as_mut_ptr(), buf.len() as c_int, dev) },
        || "cuDeviceGetPCIBusId".into(),
    )?;
    buf[63] = 0;
    // SAFETY: NUL-terminated (last byte forced above).
    Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

// ---------------------------------------------------------------------------
// Contexts
// ---------------------------------------------------------------------------

pub(crate) fn primary_ctx_retain(dev: CUdevice) -> Result<CUcontext> {
    let d = driver()?;
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: writes one handle.
    check(
        d,
        unsafe { (d.lib.cuDevicePrimaryCtxRetain)(&mut ctx, dev) },
        || format!("cuDevicePrimaryCtxRetain(device {dev})"),
    )?;
    Ok(ctx)
}

pub(crate) fn primary_ctx_release(dev: CUdevice) -> Result<()> {
    let d = driver()?;
    // SAFETY: balances one successful retain (the caller's RAII guarantees it).
    check(
        d,
        unsafe { (d.lib.cuDevicePrimaryCtxRelease_v2)(dev) },
        || format!("cuDevicePrimaryCtxRelease(device {dev})"),
    )
}

pub(crate) fn ctx_set_current(ctx: CUcontext) -> Result<()> {
    let d = driver()?;
    // SAFETY: a live context handle owned by the caller (or null to unbind).
    check(d, unsafe { (d.lib.cuCtxSetCurrent)(ctx) }, || {
        "cuCtxSetCurrent".into()
    })
}

pub(crate) fn ctx_synchronize() -> Result<()> {
    let d = driver()?;
    // SAFETY: no arguments; synchronizes the current context.
    check(d, unsafe { (d.lib.cuCtxSynchronize)() }, || {
        "cuCtxSynchronize".into()
    })
}

// ---------------------------------------------------------------------------
// Green contexts
// ---------------------------------------------------------------------------

fn zero_resource() -> CUdevResource {
    // SAFETY: CUdevResource is a plain C struct (enum tag + bytes + union of
    // plain structs); all-zero is CU_DEV_RESOURCE_TYPE_INVALID with no SMs.
    unsafe { std::mem::zeroed() }
}

/// SM count, minimum partition size and co-scheduling alignment of a resource.
pub(crate) fn sm_fields(r: &CUdevResource) -> (u32, u32, u32) {
    // SAFETY: every resource we hand out is of type SM, so `sm` is the active
    // union member (and all union members are plain integers anyway).
    let sm = unsafe { r.__bindgen_anon_1.sm };
    (sm.smCount, sm.minSmPartitionSize, sm.smCoscheduledAlignment)
}

pub(crate) fn device_sm_resource(dev: CUdevice) -> Result<CUdevResource> {
    let d = driver()?;
    let mut r = zero_resource();
    // SAFETY: writes one CUdevResource.
    check(
        d,
        unsafe {
            (d.lib.cuDeviceGetDevResource)(
                dev,
                &mut r,
                sys::CUdevResourceType::CU_DEV_RESOURCE_TYPE_SM,
            )
        },
        || format!("cuDeviceGetDevResource(device {dev}, SM)"),
    )?;
    Ok(r)
}

pub(crate) fn green_ctx_sm_resource(g: CUgreenCtx) -> Result<CUdevResource> {
    let d = driver()?;
    let mut r = zero_resource();
    // SAFETY: a live green context; writes one CUdevResource.
    check(
        d,
        unsafe {
            (d.lib.cuGreenCtxGetDevResource)(
                g,
                &mut r,
                sys::CUdevResourceType::CU_DEV_RESOURCE_TYPE_SM,
            )
        },
        || "cuGreenCtxGetDevResource(SM)".into(),
    )?;
    Ok(r)
}

/// One group of at least `min_count` SMs split off `input`, and the remainder.
pub(crate) fn sm_split_one(
    input: &CUdevResource,
    min_count: u32,
) -> Result<(CUdevResource, CUdevResource)> {
    let d = driver()?;
    let mut group = zero_resource();
    let mut rest = zero_resource();
    let mut n: c_uint = 1;
    // SAFETY: `group` has room for `n` = 1 result; input and remainder are
    // valid CUdevResource structs.
    check(
        d,
        unsafe {
            (d.lib.cuDevSmResourceSplitByCount)(&mut group, &mut n, input, &mut rest, 0, min_count)
        },
        || format!("cuDevSmResourceSplitByCount(1 group of {min_count} SMs)"),
    )?;
    if n != 1 {
        return Err(gpu_err(
            "cuDevSmResourceSplitByCount",
            format!("asked for 1 group of {min_count} SMs, got {n} groups"),
        ));
    }
    Ok((group, rest))
}

pub(crate) fn resource_desc(r: &CUdevResource) -> Result<CUdevResourceDesc> {
    let d = driver()?;
    let mut desc: CUdevResourceDesc = std::ptr::null_mut();
    let mut copy = *r;
    // SAFETY: one valid resource; writes one descriptor handle (owned by the
    // driver: the API has no destroy call for it).
    check(
        d,
        unsafe { (d.lib.cuDevResourceGenerateDesc)(&mut desc, &mut copy, 1) },
        || "cuDevResourceGenerateDesc".into(),
    )?;
    Ok(desc)
}

pub(crate) fn green_ctx_create(desc: CUdevResourceDesc, dev: CUdevice) -> Result<CUgreenCtx> {
    let d = driver()?;
    let mut g: CUgreenCtx = std::ptr::null_mut();
    // SAFETY: a descriptor from cuDevResourceGenerateDesc; writes one handle.
    check(
        d,
        unsafe {
            (d.lib.cuGreenCtxCreate)(
                &mut g,
                desc,
                dev,
                sys::CUgreenCtxCreate_flags::CU_GREEN_CTX_DEFAULT_STREAM as c_uint,
            )
        },
        || "cuGreenCtxCreate(CU_GREEN_CTX_DEFAULT_STREAM)".into(),
    )?;
    Ok(g)
}

pub(crate) fn ctx_from_green(g: CUgreenCtx) -> Result<CUcontext> {
    let d = driver()?;
    let mut c: CUcontext = std::ptr::null_mut();
    // SAFETY: a live green context; writes one handle (owned by the green
    // context: never pass it to cuCtxDestroy).
    check(d, unsafe { (d.lib.cuCtxFromGreenCtx)(&mut c, g) }, || {
        "cuCtxFromGreenCtx".into()
    })?;
    Ok(c)
}

pub(crate) fn green_ctx_stream_create(g: CUgreenCtx) -> Result<CUstream> {
    let d = driver()?;
    let mut s: CUstream = std::ptr::null_mut();
    // SAFETY: a live green context; writes one handle. CU_STREAM_NON_BLOCKING
    // is the flag the API requires for green-context streams.
    check(
        d,
        unsafe {
            (d.lib.cuGreenCtxStreamCreate)(
                &mut s,
                g,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint,
                0,
            )
        },
        || "cuGreenCtxStreamCreate".into(),
    )?;
    Ok(s)
}

pub(crate) fn green_ctx_destroy(g: CUgreenCtx) -> Result<()> {
    let d = driver()?;
    // SAFETY: the caller owns `g` and destroys it once, after its streams and
    // modules (RAII order in `context`).
    check(d, unsafe { (d.lib.cuGreenCtxDestroy)(g) }, || {
        "cuGreenCtxDestroy".into()
    })
}

// ---------------------------------------------------------------------------
// Modules and launches
// ---------------------------------------------------------------------------

pub(crate) fn module_load_data(image: &[u8]) -> Result<CUmodule> {
    let d = driver()?;
    // PTX is text and must be NUL-terminated; cubin/fatbin are ELF (or fatbin)
    // images whose size the driver reads from their headers.
    let owned;
    let ptr = if image.starts_with(b"\x7fELF") || image.last() == Some(&0) {
        image.as_ptr()
    } else {
        owned = CString::new(image).map_err(|_| {
            Error::invalid("module image: PTX text contains a NUL byte before its end")
        })?;
        owned.as_ptr().cast()
    };
    let mut m: CUmodule = std::ptr::null_mut();
    // SAFETY: `ptr` points at a complete image (NUL-terminated PTX or an ELF
    // image) that outlives the call; the driver copies it.
    check(
        d,
        unsafe { (d.lib.cuModuleLoadData)(&mut m, ptr.cast()) },
        || format!("cuModuleLoadData({} byte image)", image.len()),
    )?;
    Ok(m)
}

pub(crate) fn module_unload(m: CUmodule) -> Result<()> {
    let d = driver()?;
    // SAFETY: the caller owns `m` and unloads it once.
    check(d, unsafe { (d.lib.cuModuleUnload)(m) }, || {
        "cuModuleUnload".into()
    })
}

pub(crate) fn module_get_function(m: CUmodule, name: &str) -> Result<CUfunction> {
    let d = driver()?;
    let cname = CString::new(name)
        .map_err(|_| Error::invalid(format!("kernel name {name:?} contains a NUL byte")))?;
    let mut f: CUfunction = std::ptr::null_mut();
    // SAFETY: a live module and a NUL-terminated name; writes one handle.
    check(
        d,
        unsafe { (d.lib.cuModuleGetFunction)(&mut f, m, cname.as_ptr()) },
        || {
            format!("cuModuleGetFunction({name:?}); is the kernel extern \"C\" (or its mangled name given)?")
        },
    )?;
    Ok(f)
}

/// Loads kernel `f` onto the device now. Under lazy module loading (CUDA's
/// default) a kernel is otherwise loaded at its first launch, and loading
/// waits for work already on the device: a first launch while another
/// stream waits for that very kernel's result (a compute stream waiting for
/// a layer's copy), or while a resident kernel runs, would never return.
pub(crate) fn func_load(f: CUfunction) -> Result<()> {
    let d = driver()?;
    // SAFETY: a live function handle; loading one already loaded succeeds.
    check(d, unsafe { (d.lib.cuFuncLoad)(f) }, || "cuFuncLoad".into())
}

/// # Safety
/// `params` must hold one pointer per kernel parameter, each pointing at a
/// value of exactly that parameter's type, valid for the duration of the call
/// (the driver copies the values). Device pointers among them must be valid
/// for what the kernel does until it completes.
pub(crate) unsafe fn launch_kernel(
    f: CUfunction,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared_bytes: u32,
    stream: CUstream,
    params: &mut [*mut c_void],
) -> Result<()> {
    let d = driver()?;
    let p = if params.is_empty() {
        std::ptr::null_mut()
    } else {
        params.as_mut_ptr()
    };
    // SAFETY: the caller's contract covers the parameters; handles are live.
    check(
        d,
        unsafe {
            (d.lib.cuLaunchKernel)(
                f,
                grid.0,
                grid.1,
                grid.2,
                block.0,
                block.1,
                block.2,
                shared_bytes,
                stream,
                p,
                std::ptr::null_mut(),
            )
        },
        || format!("cuLaunchKernel(grid {grid:?}, block {block:?}, {shared_bytes} B shared)"),
    )
}

// ---------------------------------------------------------------------------
// Streams and events
// ---------------------------------------------------------------------------

pub(crate) fn stream_create() -> Result<CUstream> {
    let d = driver()?;
    let mut s: CUstream = std::ptr::null_mut();
    // SAFETY: writes one handle in the current context.
    check(
        d,
        unsafe {
            (d.lib.cuStreamCreate)(
                &mut s,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint,
            )
        },
        || "cuStreamCreate".into(),
    )?;
    Ok(s)
}

pub(crate) fn stream_destroy(s: CUstream) -> Result<()> {
    let d = driver()?;
    // SAFETY: the caller owns `s` and destroys it once.
    check(d, unsafe { (d.lib.cuStreamDestroy_v2)(s) }, || {
        "cuStreamDestroy".into()
    })
}

pub(crate) fn stream_synchronize(s: CUstream) -> Result<()> {
    let d = driver()?;
    // SAFETY: a live stream.
    check(d, unsafe { (d.lib.cuStreamSynchronize)(s) }, || {
        "cuStreamSynchronize".into()
    })
}

/// `true` when all work on the stream has completed.
pub(crate) fn stream_query(s: CUstream) -> Result<bool> {
    let d = driver()?;
    // SAFETY: a live stream.
    let rc = unsafe { (d.lib.cuStreamQuery)(s) };
    if rc == sys::CUresult::CUDA_ERROR_NOT_READY {
        return Ok(false);
    }
    check(d, rc, || "cuStreamQuery".into())?;
    Ok(true)
}

/// An event; `timing`: CU_EVENT_DEFAULT (timestamps, for `elapsed_ms`),
/// else CU_EVENT_DISABLE_TIMING (ordering only, cheaper to record).
pub(crate) fn event_create(timing: bool) -> Result<CUevent> {
    let d = driver()?;
    let mut e: CUevent = std::ptr::null_mut();
    let flags = if timing {
        sys::CUevent_flags::CU_EVENT_DEFAULT
    } else {
        sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
    };
    // SAFETY: writes one handle.
    check(
        d,
        unsafe { (d.lib.cuEventCreate)(&mut e, flags as c_uint) },
        || "cuEventCreate".into(),
    )?;
    Ok(e)
}

pub(crate) fn event_record(e: CUevent, s: CUstream) -> Result<()> {
    let d = driver()?;
    // SAFETY: live handles.
    check(d, unsafe { (d.lib.cuEventRecord)(e, s) }, || {
        "cuEventRecord".into()
    })
}

pub(crate) fn event_synchronize(e: CUevent) -> Result<()> {
    let d = driver()?;
    // SAFETY: a live event.
    check(d, unsafe { (d.lib.cuEventSynchronize)(e) }, || {
        "cuEventSynchronize".into()
    })
}

pub(crate) fn event_elapsed_ms(start: CUevent, end: CUevent) -> Result<f32> {
    let d = driver()?;
    let mut ms: f32 = 0.0;
    // SAFETY: live events; writes one float.
    check(
        d,
        unsafe { (d.lib.cuEventElapsedTime_v2)(&mut ms, start, end) },
        || "cuEventElapsedTime".into(),
    )?;
    Ok(ms)
}

pub(crate) fn event_destroy(e: CUevent) -> Result<()> {
    let d = driver()?;
    // SAFETY: the caller owns `e` and destroys it once.
    check(d, unsafe { (d.lib.cuEventDestroy_v2)(e) }, || {
        "cuEventDestroy".into()
    })
}

// ---------------------------------------------------------------------------
// Memory
// ---------------------------------------------------------------------------

pub(crate) fn mem_alloc(bytes: usize) -> Result<CUdeviceptr> {
    let d = driver()?;
    let mut p: CUdeviceptr = 0;
    // SAFETY: writes one device pointer in the current context.
    check(d, unsafe { (d.lib.cuMemAlloc_v2)(&mut p, bytes) }, || {
        format!("cuMemAlloc({bytes} bytes)")
    })?;
    Ok(p)
}

pub(crate) fn mem_free(p: CUdeviceptr) -> Result<()> {
    let d = driver()?;
    // SAFETY: the caller owns `p` (from mem_alloc) and frees it once.
    check(d, unsafe { (d.lib.cuMemFree_v2)(p) }, || "cuMemFree".into())
}

pub(crate) fn mem_alloc_host(bytes: usize) -> Result<*mut u8> {
    let d = driver()?;
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: writes one host pointer.
    check(
        d,
        unsafe { (d.lib.cuMemAllocHost_v2)(&mut p, bytes) },
        || format!("cuMemAllocHost({bytes} bytes); is RLIMIT_MEMLOCK large enough?"),
    )?;
    Ok(p.cast())
}

/// # Safety
/// `p` came from [`mem_alloc_host`], is freed once, and nothing uses it after.
pub(crate) unsafe fn mem_free_host(p: *mut u8) -> Result<()> {
    let d = driver()?;
    // SAFETY: the caller's contract.
    check(d, unsafe { (d.lib.cuMemFreeHost)(p.cast()) }, || {
        "cuMemFreeHost".into()
    })
}

/// # Safety
/// `p..p+len` must be memory of this process (or, with
/// `CU_MEMHOSTREGISTER_IOMEMORY`, an mmap of a PCI BAR) that stays mapped
/// until [`mem_host_unregister`].
pub(crate) unsafe fn mem_host_register(p: *mut u8, len: usize, flags: u32) -> Result<()> {
    let d = driver()?;
    // SAFETY: the caller's contract.
    check(
        d,
        unsafe { (d.lib.cuMemHostRegister_v2)(p.cast(), len, flags as c_uint) },
        || format!("cuMemHostRegister({p:p}, {len} bytes, flags {flags:#x})"),
    )
}

/// # Safety
/// `p` was registered with [`mem_host_register`] and no GPU work still uses it.
pub(crate) unsafe fn mem_host_unregister(p: *mut u8) -> Result<()> {
    let d = driver()?;
    // SAFETY: the caller's contract.
    check(d, unsafe { (d.lib.cuMemHostUnregister)(p.cast()) }, || {
        format!("cuMemHostUnregister({p:p})")
    })
}

pub(crate) fn mem_host_device_pointer(p: *mut u8) -> Result<CUdeviceptr> {
    let d = driver()?;
    let mut dp: CUdeviceptr = 0;
    // SAFETY: only looks the address up; writes one device pointer.
    check(
        d,
        unsafe { (d.lib.cuMemHostGetDevicePointer_v2)(&mut dp, p.cast(), 0) },
        || format!("cuMemHostGetDevicePointer({p:p})"),
    )?;
    Ok(dp)
}

/// # Safety
/// `dst..dst+src.len()` must be device memory the caller may write.
pub(crate) unsafe fn memcpy_htod(dst: CUdeviceptr, src: &[u8]) -> Result<()> {
    let d = driver()?;
    // SAFETY: src is a live slice; dst per the caller's contract. Synchronous.
    check(
        d,
        unsafe { (d.lib.cuMemcpyHtoD_v2)(dst, src.as_ptr().cast(), src.len()) },
        || format!("cuMemcpyHtoD({} bytes to {dst:#x})", src.len()),
    )
}

/// # Safety
/// `src..src+dst.len()` must be device memory the caller may read.
pub(crate) unsafe fn memcpy_dtoh(dst: &mut [u8], src: CUdeviceptr) -> Result<()> {
    let d = driver()?;
    // SAFETY: dst is a live slice; src per the caller's contract. Synchronous.
    check(
        d,
        unsafe { (d.lib.cuMemcpyDtoH_v2)(dst.as_mut_ptr().cast(), src, dst.len()) },
        || format!("cuMemcpyDtoH({} bytes from {src:#x})", dst.len()),
    )
}

/// # Safety
/// Both ranges (unified addresses: device memory or registered/pinned host
/// memory) must stay valid until the copy completes on `s`.
pub(crate) unsafe fn memcpy_async(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    len: usize,
    s: CUstream,
) -> Result<()> {
    let d = driver()?;
    // SAFETY: the caller's contract.
    check(
        d,
        unsafe { (d.lib.cuMemcpyAsync)(dst, src, len, s) },
        || format!("cuMemcpyAsync({len} bytes {src:#x} -> {dst:#x})"),
    )
}

/// # Safety
/// `dst..dst+len` must be device memory the caller may write.
pub(crate) unsafe fn memset_d8(dst: CUdeviceptr, v: u8, len: usize) -> Result<()> {
    let d = driver()?;
    // SAFETY: the caller's contract.
    check(d, unsafe { (d.lib.cuMemsetD8_v2)(dst, v, len) }, || {
        format!("cuMemsetD8({len} bytes at {dst:#x})")
    })
}

/// Which device a unified address belongs to (`None` for host memory the
/// driver does not know).
pub(crate) fn pointer_device_ordinal(p: CUdeviceptr) -> Result<Option<i32>> {
    let d = driver()?;
    let mut v: c_int = -1;
    // SAFETY: writes one int for the DEVICE_ORDINAL attribute.
    let rc = unsafe {
        (d.lib.cuPointerGetAttribute)(
            (&mut v as *mut c_int).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            p,
        )
    };
    if rc == sys::CUresult::CUDA_ERROR_INVALID_VALUE {
        return Ok(None);
    }
    check(d, rc, || {
        format!("cuPointerGetAttribute({p:#x}, DEVICE_ORDINAL)")
    })?;
    Ok(Some(v))
}

/// # Safety
/// `addr` must be a 4-byte aligned unified address (device memory or
/// registered/pinned host memory) that stays valid until the wait completes.
pub(crate) unsafe fn stream_wait_value32(
    s: CUstream,
    addr: CUdeviceptr,
    value: u32,
    flags: u32,
) -> Result<()> {
    let d = driver()?;
    // SAFETY: the caller's contract.
    check(
        d,
        unsafe { (d.lib.cuStreamWaitValue32_v2)(s, addr, value, flags as c_uint) },
        || format!("cuStreamWaitValue32({addr:#x}, {value}, flags {flags:#x})"),
    )
}

/// Later work on `s` waits until the work recorded in `e` (on another
/// stream) is done: a dependency CUDA's scheduler sees, unlike a stream
/// memory wait.
///
/// # Safety
/// `s` is a live stream of the current context (0: its legacy default
/// stream); `e` a live event of the same context.
pub(crate) unsafe fn stream_wait_event(s: CUstream, e: CUevent) -> Result<()> {
    let d = driver()?;
    // SAFETY: the caller's contract; flags must be 0.
    check(d, unsafe { (d.lib.cuStreamWaitEvent)(s, e, 0) }, || {
        "cuStreamWaitEvent".into()
    })
}

/// # Safety
/// As [`stream_wait_value32`], for a write.
pub(crate) unsafe fn stream_write_value32(
    s: CUstream,
    addr: CUdeviceptr,
    value: u32,
) -> Result<()> {
    let d = driver()?;
    // SAFETY: the caller's contract.
    check(
        d,
        unsafe {
            (d.lib.cuStreamWriteValue32_v2)(
                s,
                addr,
                value,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as c_uint,
            )
        },
        || format!("cuStreamWriteValue32({addr:#x}, {value})"),
    )
}

/// A dma-buf file descriptor for `len` bytes of device memory at `p`
/// (`p` and `len` aligned to the host page size).
pub(crate) fn mem_dma_buf_fd(p: CUdeviceptr, len: usize) -> Result<OwnedFd> {
    let d = driver()?;
    let mut fd: c_int = -1;
    // SAFETY: writes one int (the fd) for a device range; the driver checks it.
    check(
        d,
        unsafe {
            (d.lib.cuMemGetHandleForAddressRange)(
                (&mut fd as *mut c_int).cast(),
                p,
                len,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        },
        || {
            format!("cuMemGetHandleForAddressRange({p:#x}, {len} bytes, DMA_BUF_FD); needs the open NVIDIA kernel module and CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED")
        },
    )?;
    if fd < 0 {
        return Err(gpu_err("cuMemGetHandleForAddressRange", "returned no fd"));
    }
    // SAFETY: a fresh fd the driver handed to us; we own it from here.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_a_clear_error_not_a_panic() {
        let err = preflight(c"libcuda-kvtier-does-not-exist.so.1").unwrap_err();
        assert_eq!((err.stage, err.version), (LoadStage::NotFound, None));
        let e = err.reason;
        assert!(
            e.starts_with("no CUDA driver: libcuda-kvtier-does-not-exist.so.1 not found"),
            "{e}"
        );
        assert!(e.contains("install the NVIDIA driver"), "{e}");
    }

    #[test]
    fn a_library_that_is_not_libcuda_is_named() {
        // libc is on every Linux machine and has no CUDA symbols.
        let err = preflight(c"libc.so.6").unwrap_err();
        assert_eq!(err.stage, LoadStage::NotCuda);
        let e = err.reason;
        assert!(e.contains("libc.so.6 is not a CUDA driver library"), "{e}");
        assert!(e.contains("cuDriverGetVersion"), "{e}");
    }

    #[test]
    fn symbol_lists_are_the_names_cudarc_binds() {
        // Every name must be unique (a typo duplicated would hide a missing one).
        let mut all: Vec<&CStr> = REQUIRED.iter().chain(GREEN).copied().collect();
        all.sort();
        let n = all.len();
        all.dedup();
        assert_eq!(all.len(), n);
        assert!(GREEN.contains(&c"cuGreenCtxCreate"));
    }
}

use super::*;
use std::collections::HashMap;
use std::os::unix::fs::symlink;
use std::sync::{Arc, Mutex};

const ADDR: &str = "0000:00:04.0";

/// What the fake kernel saw: sysfs writes (path under the root, value)
/// and module loads, in order.
type Log = Arc<Mutex<Vec<(String, String)>>>;

/// A sysfs tree of plain files in a temporary directory and a "kernel"
/// that reacts to writes to `bind`/`unbind` the way Linux does: moving
/// the function's `driver` link, refusing a bind that `driver_override`
/// forbids or a bind of a bound function.
struct Fake {
    root: PathBuf,
    log: Log,
    /// Block device name -> first bytes (absent: zeros).
    heads: HashMap<String, Vec<u8>>,
    /// Block device name -> how it is in use.
    uses: HashMap<String, String>,
    /// Modules `modprobe` can load (each provides the driver of its name).
    loadable: Vec<String>,
    /// Writes to these files (under the root) fail with EIO.
    failing: Vec<String>,
    /// The driver that, like a driver whose probe fails, never takes the function.
    refuses: Option<String>,
}

struct Tree {
    root: PathBuf,
    log: Log,
}

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.root);
    }
}

impl Tree {
    /// One PCI function at ADDR of `class`, bound to `driver`, the
    /// drivers nvme, vfio-pci and uio_pci_generic loaded.
    fn new(tag: &str, class: &str, driver: Option<&str>) -> Tree {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let root = std::env::temp_dir().join(format!(
            "kvtier-bind-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&root);
        let t = Tree {
            root,
            log: Arc::default(),
        };
        for d in ["nvme", "vfio-pci", "uio_pci_generic"] {
            t.add_driver(d);
        }
        let dev = t.dev();
        fs::create_dir_all(&dev).unwrap();
        fs::write(dev.join("class"), format!("{class}\n")).unwrap();
        fs::write(dev.join("vendor"), "0x1b36\n").unwrap();
        fs::write(dev.join("device"), "0x0010\n").unwrap();
        fs::write(dev.join("driver_override"), "(null)\n").unwrap();
        if let Some(d) = driver {
            symlink(format!("../../drivers/{d}"), dev.join("driver")).unwrap();
        }
        t
    }

    fn add_driver(&self, d: &str) {
        let dir = self.root.join("bus/pci/drivers").join(d);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("bind"), "").unwrap();
        fs::write(dir.join("unbind"), "").unwrap();
    }

    fn dev(&self) -> PathBuf {
        self.root.join("bus/pci/devices").join(ADDR)
    }

    /// Namespace `name` of controller nvme0 (sysfs entry `entry`, e.g.
    /// nvme0c0n1 for a multipath path), with partitions `parts`.
    fn namespace(&self, entry: &str, name: &str, parts: &[&str]) {
        fs::create_dir_all(self.dev().join("nvme/nvme0").join(entry)).unwrap();
        let dir = self.root.join("class/block").join(name);
        fs::create_dir_all(dir.join("holders")).unwrap();
        fs::write(dir.join("dev"), "259:0\n").unwrap();
        for p in parts {
            fs::create_dir_all(dir.join(p).join("holders")).unwrap();
            fs::write(dir.join(p).join("partition"), "1\n").unwrap();
        }
    }

    fn fake(&self) -> Fake {
        Fake {
            root: self.root.clone(),
            log: self.log.clone(),
            heads: HashMap::new(),
            uses: HashMap::new(),
            loadable: Vec::new(),
            failing: Vec::new(),
            refuses: None,
        }
    }

    fn driver(&self) -> Option<String> {
        link_name(self.dev().join("driver"))
    }

    fn override_text(&self) -> String {
        fs::read_to_string(self.dev().join("driver_override")).unwrap()
    }

    fn writes(&self) -> Vec<(String, String)> {
        self.log.lock().unwrap().clone()
    }

    fn clear(&self) {
        self.log.lock().unwrap().clear();
    }
}

fn os(code: i32) -> io::Error {
    io::Error::from_raw_os_error(code)
}

impl Kernel for Fake {
    fn root(&self) -> &Path {
        &self.root
    }

    fn write(&mut self, path: &Path, value: &str) -> io::Result<()> {
        let rel = path.strip_prefix(&self.root).expect("write under the root");
        let rel_s = rel.to_string_lossy().into_owned();
        self.log
            .lock()
            .unwrap()
            .push((rel_s.clone(), value.to_string()));
        if self.failing.contains(&rel_s) {
            return Err(os(libc::EIO));
        }
        // sysfs attributes exist; writing never creates a file.
        if !path.is_file() {
            return Err(os(libc::ENOENT));
        }
        let parts: Vec<&str> = rel_s.split('/').collect();
        match parts.as_slice() {
            ["bus", "pci", "drivers", drv, op @ ("bind" | "unbind")] => {
                let dev = self.root.join("bus/pci/devices").join(value.trim());
                let link = dev.join("driver");
                let cur = link_name(&link);
                if *op == "unbind" {
                    if cur.as_deref() != Some(*drv) {
                        return Err(os(libc::ENODEV));
                    }
                    fs::remove_file(&link)?;
                } else {
                    let ovr = fs::read_to_string(dev.join("driver_override"))?;
                    let ovr = ovr.trim();
                    let allowed = ovr.is_empty() || ovr == "(null)" || ovr == *drv;
                    if cur.is_some() {
                        return Err(os(libc::EBUSY));
                    }
                    if !allowed || self.refuses.as_deref() == Some(*drv) {
                        return Err(os(libc::ENODEV));
                    }
                    symlink(format!("../../drivers/{drv}"), &link)?;
                }
                Ok(())
            }
            _ => fs::write(path, value),
        }
    }

    fn modprobe(&mut self, module: &str) -> std::result::Result<(), String> {
        self.log
            .lock()
            .unwrap()
            .push(("modprobe".into(), module.to_string()));
        if !self.loadable.iter().any(|m| m == module) {
            return Err(format!("modprobe: FATAL: Module {module} not found"));
        }
        let dir = self.root.join("bus/pci/drivers").join(module);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("bind"), "").unwrap();
        fs::write(dir.join("unbind"), "").unwrap();
        Ok(())
    }

    fn block_use(&self, name: &str, _dir: &Path) -> Result<Option<String>> {
        Ok(self.uses.get(name).cloned())
    }

    fn block_head(&self, name: &str, _dir: &Path) -> Result<Vec<u8>> {
        Ok(self
            .heads
            .get(name)
            .cloned()
            .unwrap_or_else(|| vec![0; 4096]))
    }
}

fn w(path: &str, value: &str) -> (String, String) {
    (path.to_string(), value.to_string())
}

fn bind(fake: Fake, driver: BindDriver, force: bool) -> Result<PciBinding> {
    PciBinding::bind_with(Box::new(fake), ADDR, driver, force)
}

fn ext4_head() -> Vec<u8> {
    let mut h = vec![0u8; 4096];
    h[1080..1082].copy_from_slice(&[0x53, 0xef]);
    h
}

const OVR: &str = "bus/pci/devices/0000:00:04.0/driver_override";

#[test]
fn addresses_must_be_full_pci_addresses() {
    assert_eq!(parse_pci_address("0000:00:04.0").unwrap(), "0000:00:04.0");
    assert_eq!(parse_pci_address("0000:AF:1F.7").unwrap(), "0000:af:1f.7");
    for bad in [
        "00:04.0",
        "0000:00:04",
        "0000:00:04.0 ",
        "0000:00:04.0/",
        "0000:00:20.0",
        "0000:00:04.8",
        "0000:0g:04.0",
        "../../../dev",
        "0000/00:04.0",
        "+000:00:04.0",
        "",
    ] {
        let e = parse_pci_address(bad).unwrap_err().to_string();
        assert!(
            e.contains("not a full PCI address") && e.contains("DDDD:BB:DD.F"),
            "{bad}: {e}"
        );
    }
    // Binding refuses them before touching anything, force or not.
    let t = Tree::new("addr", "0x010802", Some("nvme"));
    for bad in ["00:04.0", "0000:00:04.0\n", "0000:00:04.0/../../x"] {
        let e =
            PciBinding::bind_with(Box::new(t.fake()), bad, BindDriver::VfioPci, true).unwrap_err();
        assert!(e.to_string().contains("not a full PCI address"), "{e}");
    }
    let e = PciBinding::bind_with(
        Box::new(t.fake()),
        "0000:00:05.0",
        BindDriver::VfioPci,
        true,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("no PCI function 0000:00:05.0") && e.contains("kvtier nvme list"),
        "{e}"
    );
    assert!(t.writes().is_empty(), "{:?}", t.writes());
    assert_eq!(t.driver().as_deref(), Some("nvme"));
}

#[test]
fn driver_names() {
    assert_eq!(BindDriver::parse("vfio-pci").unwrap(), BindDriver::VfioPci);
    assert_eq!(BindDriver::parse("vfio_pci").unwrap(), BindDriver::VfioPci);
    assert_eq!(
        BindDriver::parse("uio_pci_generic").unwrap(),
        BindDriver::UioPciGeneric
    );
    assert_eq!(BindDriver::parse("uio").unwrap(), BindDriver::UioPciGeneric);
    let e = BindDriver::parse("nvme").unwrap_err().to_string();
    assert!(
        e.contains("vfio-pci") && e.contains("uio_pci_generic"),
        "{e}"
    );
}

#[test]
fn namespace_names_and_multipath_paths() {
    assert_eq!(namespace_name("nvme0n1").as_deref(), Some("nvme0n1"));
    assert_eq!(namespace_name("nvme3c5n12").as_deref(), Some("nvme3n12"));
    for not in [
        "ng0n1",
        "nvme0",
        "nvme0n",
        "nvme0n1p1",
        "nvmexn1",
        "nvme0c0",
        "power",
        "nvme0cn1",
    ] {
        assert_eq!(namespace_name(not), None, "{not}");
    }
}

#[test]
fn bind_and_restore_write_the_kernel_sequence() {
    let t = Tree::new("seq", "0x010802", Some("nvme"));
    t.namespace("nvme0n1", "nvme0n1", &["nvme0n1p1"]);
    let b = bind(t.fake(), BindDriver::VfioPci, false).unwrap();
    assert_eq!(
        t.writes(),
        vec![
            w(OVR, "vfio-pci"),
            w("bus/pci/drivers/nvme/unbind", ADDR),
            w("bus/pci/drivers/vfio-pci/bind", ADDR),
        ]
    );
    assert_eq!(t.driver().as_deref(), Some("vfio-pci"));
    assert_eq!(b.original_driver(), Some("nvme"));
    assert!(b.forced().is_empty() && !b.was_already_bound());
    t.clear();
    b.restore().unwrap();
    assert_eq!(
        t.writes(),
        vec![
            w("bus/pci/drivers/vfio-pci/unbind", ADDR),
            w(OVR, "\n"),
            w("bus/pci/drivers/nvme/bind", ADDR),
        ]
    );
    assert_eq!(t.driver().as_deref(), Some("nvme"));
}

#[test]
fn drop_restores_and_an_unbound_function_stays_unbound() {
    let t = Tree::new("drop", "0x010802", Some("nvme"));
    {
        let _b = bind(t.fake(), BindDriver::UioPciGeneric, false).unwrap();
        assert_eq!(t.driver().as_deref(), Some("uio_pci_generic"));
    }
    assert_eq!(t.driver().as_deref(), Some("nvme"));
    assert_eq!(t.override_text(), "\n");

    let t = Tree::new("unbound", "0x010802", None);
    let b = bind(t.fake(), BindDriver::UioPciGeneric, false).unwrap();
    assert_eq!(
        t.writes(),
        vec![
            w(OVR, "uio_pci_generic"),
            w("bus/pci/drivers/uio_pci_generic/bind", ADDR)
        ]
    );
    assert_eq!(b.original_driver(), None);
    t.clear();
    drop(b);
    assert_eq!(
        t.writes(),
        vec![
            w("bus/pci/drivers/uio_pci_generic/unbind", ADDR),
            w(OVR, "\n")
        ]
    );
    assert_eq!(t.driver(), None);
}

#[test]
fn an_original_driver_override_is_put_back() {
    let t = Tree::new("ovr", "0x010802", Some("nvme"));
    fs::write(t.dev().join("driver_override"), "nvme\n").unwrap();
    bind(t.fake(), BindDriver::VfioPci, false)
        .unwrap()
        .restore()
        .unwrap();
    assert_eq!(t.override_text(), "nvme\n");
    assert_eq!(t.driver().as_deref(), Some("nvme"));
}

#[test]
fn already_bound_to_the_driver_changes_nothing() {
    let t = Tree::new("same", "0x010802", Some("vfio-pci"));
    let b = bind(t.fake(), BindDriver::VfioPci, false).unwrap();
    assert!(b.was_already_bound());
    b.restore().unwrap();
    assert!(t.writes().is_empty(), "{:?}", t.writes());
    assert_eq!(t.driver().as_deref(), Some("vfio-pci"));
}

#[test]
fn not_nvme_is_refused_unless_forced() {
    let t = Tree::new("class", "0x020000", Some("e1000e"));
    t.add_driver("e1000e");
    let e = bind(t.fake(), BindDriver::VfioPci, false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("not an NVMe controller")
            && e.contains("0x020000")
            && e.contains("force the bind"),
        "{e}"
    );
    assert!(t.writes().is_empty(), "{:?}", t.writes());
    assert_eq!(t.driver().as_deref(), Some("e1000e"));
    let b = bind(t.fake(), BindDriver::VfioPci, true).unwrap();
    assert_eq!(b.forced().len(), 1);
    assert_eq!(t.driver().as_deref(), Some("vfio-pci"));
    drop(b);
    assert_eq!(t.driver().as_deref(), Some("e1000e"));
}

#[test]
fn mounted_namespace_is_refused_unless_forced() {
    let t = Tree::new("mounted", "0x010802", Some("nvme"));
    t.namespace("nvme0n1", "nvme0n1", &["nvme0n1p1"]);
    let mut f = t.fake();
    f.uses.insert(
        "nvme0n1".into(),
        "its partition /dev/nvme0n1p1 is mounted at /data".into(),
    );
    let e = bind(f, BindDriver::VfioPci, false).unwrap_err().to_string();
    assert!(
        e.contains("/dev/nvme0n1")
            && e.contains("mounted at /data")
            && e.contains("unmount")
            && e.contains("force the bind"),
        "{e}"
    );
    assert!(t.writes().is_empty(), "{:?}", t.writes());
    assert_eq!(t.driver().as_deref(), Some("nvme"));

    let mut f = t.fake();
    f.uses
        .insert("nvme0n1".into(), "it is mounted at /data".into());
    let b = bind(f, BindDriver::VfioPci, true).unwrap();
    assert!(b.forced()[0].contains("/data"), "{:?}", b.forced());
    assert_eq!(t.driver().as_deref(), Some("vfio-pci"));
}

#[test]
fn signatures_are_refused_naming_the_device_and_what_it_holds() {
    let t = Tree::new("sig", "0x010802", Some("nvme"));
    t.namespace("nvme0n1", "nvme0n1", &["nvme0n1p1"]);
    let mut f = t.fake();
    f.heads.insert("nvme0n1p1".into(), ext4_head());
    let e = bind(f, BindDriver::UioPciGeneric, false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("/dev/nvme0n1p1 holds an ext2/3/4 filesystem") && e.contains("force the bind"),
        "{e}"
    );
    assert!(!e.contains("/dev/nvme0n1 holds"), "{e}");
    assert!(t.writes().is_empty());

    let mut gpt = vec![0u8; 4096];
    gpt[512..520].copy_from_slice(b"EFI PART");
    let mut f = t.fake();
    f.heads.insert("nvme0n1".into(), gpt);
    let e = bind(f, BindDriver::UioPciGeneric, false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("/dev/nvme0n1 holds a GPT partition table"),
        "{e}"
    );

    // A kvtier pool is ours, and unknown bytes are not a filesystem.
    let mut pool = vec![0u8; 4096];
    pool[..8].copy_from_slice(b"KVTIERPL");
    let mut f = t.fake();
    f.heads.insert("nvme0n1".into(), pool);
    f.heads.insert("nvme0n1p1".into(), vec![0xa5; 4096]);
    let b = bind(f, BindDriver::UioPciGeneric, false).unwrap();
    assert!(b.forced().is_empty());
    b.restore().unwrap();

    // Forced: bound, and the note names the filesystem.
    let mut f = t.fake();
    f.heads.insert("nvme0n1".into(), ext4_head());
    let b = bind(f, BindDriver::UioPciGeneric, true).unwrap();
    assert!(b.forced()[0].contains("ext2/3/4"), "{:?}", b.forced());
    assert_eq!(t.driver().as_deref(), Some("uio_pci_generic"));
}

#[test]
fn held_and_multipath_namespaces_are_checked() {
    let t = Tree::new("held", "0x010802", Some("nvme"));
    // A multipath path device: the visible disk is nvme0n1 under class/block.
    t.namespace("nvme0c0n1", "nvme0n1", &[]);
    fs::write(t.root.join("class/block/nvme0n1/holders/dm-0"), "").unwrap();
    let e = bind(t.fake(), BindDriver::VfioPci, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("/dev/nvme0n1 is held by /dev/dm-0"), "{e}");
    let list = list_in(&t.fake()).unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].block_devices.len(), 1);
    assert_eq!(list[0].block_devices[0].name, "nvme0n1");
}

#[test]
fn a_missing_driver_is_loaded_or_named() {
    let t = Tree::new("modprobe", "0x010802", Some("nvme"));
    fs::remove_dir_all(t.root.join("bus/pci/drivers/uio_pci_generic")).unwrap();
    let e = bind(t.fake(), BindDriver::UioPciGeneric, false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("load the kernel module uio_pci_generic") && e.contains("not found"),
        "{e}"
    );
    assert_eq!(t.writes(), vec![w("modprobe", "uio_pci_generic")]);
    assert_eq!(t.driver().as_deref(), Some("nvme"));
    t.clear();
    let mut f = t.fake();
    f.loadable.push("uio_pci_generic".into());
    let _b = bind(f, BindDriver::UioPciGeneric, false).unwrap();
    assert_eq!(t.writes()[0], w("modprobe", "uio_pci_generic"));
    assert_eq!(t.driver().as_deref(), Some("uio_pci_generic"));
}

#[test]
fn a_failed_bind_puts_the_original_driver_back() {
    let t = Tree::new("fail", "0x010802", Some("nvme"));
    let mut f = t.fake();
    f.refuses = Some("vfio-pci".into());
    let e = bind(f, BindDriver::VfioPci, false).unwrap_err().to_string();
    assert!(
        e.contains("drivers/vfio-pci/bind") && e.contains(ADDR),
        "{e}"
    );
    assert_eq!(t.driver().as_deref(), Some("nvme"));
    assert_eq!(t.override_text(), "\n");
    assert_eq!(
        t.writes().last().unwrap(),
        &w("bus/pci/drivers/nvme/bind", ADDR)
    );
}

#[test]
fn write_errors_name_the_file() {
    let t = Tree::new("eio", "0x010802", Some("nvme"));
    let mut f = t.fake();
    f.failing.push("bus/pci/drivers/nvme/unbind".into());
    let e = bind(f, BindDriver::VfioPci, false).unwrap_err().to_string();
    assert!(
        e.contains(&format!("writing '{ADDR}' to "))
            && e.contains("bus/pci/drivers/nvme/unbind")
            && e.contains("Input/output error"),
        "{e}"
    );
    // Still bound to nvme; the override kvtier set is cleared again.
    assert_eq!(t.driver().as_deref(), Some("nvme"));
    assert_eq!(t.override_text(), "\n");

    // A restore that fails says so, naming the file.
    let t = Tree::new("eio2", "0x010802", Some("nvme"));
    let mut f = t.fake();
    f.failing.push("bus/pci/drivers/vfio-pci/unbind".into());
    let b = bind(f, BindDriver::VfioPci, false).unwrap();
    let e = b.restore().unwrap_err().to_string();
    assert!(e.contains("drivers/vfio-pci/unbind"), "{e}");
}

#[test]
fn list_shows_nvme_controllers_with_their_block_devices() {
    let t = Tree::new("list", "0x010802", Some("nvme"));
    t.namespace("nvme0n1", "nvme0n1", &["nvme0n1p1", "nvme0n1p2"]);
    let other = t.root.join("bus/pci/devices/0000:00:03.0");
    fs::create_dir_all(&other).unwrap();
    fs::write(other.join("class"), "0x020000\n").unwrap();
    let mut f = t.fake();
    f.heads.insert("nvme0n1p2".into(), ext4_head());
    f.uses.insert(
        "nvme0n1".into(),
        "its partition /dev/nvme0n1p2 is mounted at /".into(),
    );
    let list = list_in(&f).unwrap();
    assert_eq!(list.len(), 1, "{list:?}");
    let c = &list[0];
    assert_eq!(
        (c.addr.as_str(), c.id.as_str(), c.class),
        (ADDR, "1b36:0010", 0x010802)
    );
    assert_eq!(c.driver.as_deref(), Some("nvme"));
    let names: Vec<&str> = c.block_devices.iter().map(|b| b.name.as_str()).collect();
    assert_eq!(names, ["nvme0n1", "nvme0n1p1", "nvme0n1p2"]);
    assert!(c.block_devices[0].problems[0].contains("mounted at /"));
    assert!(c.block_devices[1].problems.is_empty());
    assert_eq!(
        c.block_devices[2].signature,
        Some(Signature::Filesystem("ext2/3/4"))
    );
}

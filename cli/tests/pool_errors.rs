//! Bad input to the pool, each with the error a user needs to fix it.

#[path = "../../tests/common/mod.rs"]
mod common;

use common::*;
use kvtier::pool::layout::{BlockHeader, DATA_OFFSET};
use kvtier::pool::{DeviceSpec, Key, OpenExpect, Pool};
use kvtier::tier::{Tier, TierConfig};
use kvtier::{HostKvCache, HostLayout};
use std::os::unix::fs::FileExt;
use std::sync::Arc;

/// `kvtier pool create --dev DEV --size SIZE --model MODEL` plus `extra`.
fn create(dev: &std::path::Path, size: &str, model: &str, extra: &[&str]) -> (i32, String) {
    let mut args = vec![
        "pool",
        "create",
        "--dev",
        dev.to_str().unwrap(),
        "--size",
        size,
        "--model",
        model,
    ];
    args.extend_from_slice(extra);
    kvtier(&args)
}

fn kvtier(args: &[&str]) -> (i32, String) {
    run_cli(env!("CARGO_BIN_EXE_kvtier"), args)
}

fn stored_pool(dir: &TempDir, keys: u64) -> Vec<std::path::PathBuf> {
    let geo = tiny_geometry();
    let pool = create_pool(dir, geo, 8, 1, 4);
    let paths = pool.paths();
    let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, keys as u32, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    for k in 0..keys {
        cache.fill_block(k as u32, seed_of(k));
    }
    let ks: Vec<Key> = (0..keys).map(Key::from_u64).collect();
    let mem: Vec<u32> = (0..keys as u32).collect();
    let job = tier.submit_store(&ks, &mem).unwrap();
    assert!(tier.wait(job).unwrap().all_ok());
    paths
}

#[test]
fn reopen_with_another_models_geometry_is_refused() {
    let dir = TempDir::new("geomismatch");
    let paths = stored_pool(&dir, 2);
    let mut other = tiny_geometry();
    other.kv_heads = 4;
    let err = Pool::open(
        &paths,
        &OpenExpect {
            geometry: Some(other),
            namespace: None,
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("was created for") && err.contains("2 kv heads") && err.contains("4 kv heads"),
        "{err}"
    );
    let err = Pool::open(
        &paths,
        &OpenExpect {
            geometry: None,
            namespace: Some("llama/tp1".into()),
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("namespace") && err.contains("llama/tp1"),
        "{err}"
    );
}

#[test]
fn backing_file_too_small_is_refused() {
    let dir = TempDir::new("small");
    let geo = tiny_geometry();
    let cfg = pool_config(geo, 8, &[], 1).with_devices(vec![DeviceSpec {
        path: dir.file("a.pool"),
        size: Some(1 << 20),
    }]);
    let err = Pool::create(&cfg).err().unwrap().to_string();
    assert!(
        err.contains("a.pool") && err.contains("1 MiB") && err.contains("needs at least"),
        "{err}"
    );
    let (code, text) = create(&dir.file("b.pool"), "64m", "llama3-70b", &[]);
    assert_ne!(code, 0);
    assert!(text.contains("b.pool") && text.contains("--size"), "{text}");
}

#[test]
fn missing_device_or_foreign_file_is_refused() {
    let dir = TempDir::new("missing");
    let paths = stored_pool(&dir, 2);
    // A pool of one device opened with an extra, unrelated file.
    let foreign = dir.file("foreign");
    std::fs::write(&foreign, vec![7u8; 8192]).unwrap();
    let err = Pool::open(&[paths[0].clone(), foreign], &OpenExpect::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("foreign") && err.contains("not a kvtier pool"),
        "{err}"
    );
    let err = Pool::open(&[dir.file("nope")], &OpenExpect::default())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("nope"), "{err}");
}

#[test]
fn corrupted_header_hides_the_block_and_check_fails() {
    let dir = TempDir::new("corrupt");
    let paths = stored_pool(&dir, 4);
    // Slot 2's header is the third 4 KiB sector of group 0.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&paths[0])
        .unwrap();
    let off = DATA_OFFSET + 2 * 4096 + std::mem::offset_of!(BlockHeader, generation) as u64;
    f.write_all_at(&[0xFF], off).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let pool = Pool::open(&paths, &OpenExpect::default()).unwrap();
    assert_eq!(pool.damaged_headers(), &[2]);
    assert_eq!(
        pool.index().live(),
        3,
        "the damaged block is never returned"
    );
    assert!(pool.index().get(&Key::from_u64(2)).is_none());
    drop(pool);
    let (code, text) = kvtier(&["pool", "check", "--dev", paths[0].to_str().unwrap()]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("damaged header: slot 2") && text.contains("DAMAGED"),
        "{text}"
    );
}

#[test]
fn corrupted_data_is_reported_by_check() {
    let dir = TempDir::new("baddata");
    let paths = stored_pool(&dir, 4);
    let (code, text) = kvtier(&["pool", "check", "--dev", paths[0].to_str().unwrap()]);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains("4 live block(s) checked, 4 ok") && text.contains("pool is clean"),
        "{text}"
    );
    // Flip a byte in layer 3's V object of slot 1.
    let geo = tiny_geometry();
    let layout = kvtier::pool::layout::PoolLayout::new(geo, 8, vec![4]);
    let (_, off) = layout.object_offset(1, 3, 1);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&paths[0])
        .unwrap();
    f.write_all_at(&[0x5A], off + 100).unwrap();
    drop(f);
    let (code, text) = kvtier(&["pool", "check", "--dev", paths[0].to_str().unwrap()]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("bad data: slot 1 key 0100000000000000"),
        "{text}"
    );
    // --json: stdout is one JSON document; the verdict goes to stderr.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args([
            "pool",
            "check",
            "--json",
            "--dev",
            paths[0].to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    assert_eq!(v["bad_data"].as_array().map(Vec::len), Some(1), "{v}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("pool is DAMAGED"));
}

#[test]
fn corrupted_superblock_names_the_device() {
    let dir = TempDir::new("badsb");
    let paths = stored_pool(&dir, 1);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&paths[0])
        .unwrap();
    // Every copy: one damaged copy alone costs nothing (tests/integrity.rs).
    for off in kvtier::pool::layout::SUPERBLOCK_OFFSETS {
        f.write_all_at(&[0x11], off + 70).unwrap();
    }
    drop(f);
    let err = Pool::open(&paths, &OpenExpect::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("ssd0.pool") && err.contains("superblock") && err.contains("checksum"),
        "{err}"
    );
}

#[test]
fn malformed_model_config_is_refused_by_the_cli() {
    let dir = TempDir::new("badconfig");
    let cfg = dir.file("config.json");
    std::fs::write(&cfg, r#"{"num_hidden_layers": 32, "hidden_size": 4096,"#).unwrap();
    let dev = dir.file("p.pool");
    let (code, text) = create(&dev, "64m", cfg.to_str().unwrap(), &[]);
    assert_ne!(code, 0);
    assert!(
        text.contains("config.json") && text.contains("line"),
        "{text}"
    );
    std::fs::write(
        &cfg,
        r#"{"hidden_size": 4096, "num_attention_heads": 32, "torch_dtype": "bfloat16"}"#,
    )
    .unwrap();
    let (code, text) = create(&dev, "64m", cfg.to_str().unwrap(), &[]);
    assert_ne!(code, 0);
    assert!(text.contains("num_hidden_layers"), "{text}");
    assert!(!dev.exists(), "nothing is created on bad input");
}

#[test]
fn cli_create_info_round_trip() {
    let dir = TempDir::new("cli");
    let a = dir.file("a.pool");
    let b = dir.file("b.pool");
    let (code, text) = create(
        &a,
        "300m",
        "llama3-8b",
        &["--dev", b.to_str().unwrap(), "--group-blocks", "16"],
    );
    assert_eq!(code, 0, "{text}");
    let (code, text) = kvtier(&[
        "pool",
        "info",
        "--json",
        "--dev",
        b.to_str().unwrap(),
        "--dev",
        a.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["geometry"]["layers"], 32);
    assert_eq!(v["group_blocks"], 16);
    assert_eq!(v["devices"].as_array().unwrap().len(), 2);
    assert_eq!(v["namespace"], "llama3-8b/bfloat16/bs16/tp0");
    // Creating over an existing, non-pool file needs --force.
    std::fs::write(dir.file("data"), vec![1u8; 4096]).unwrap();
    let (code, text) = create(&dir.file("data"), "300m", "llama3-8b", &[]);
    assert_ne!(code, 0);
    assert!(text.contains("--force"), "{text}");
}

/// `pool create --dev FILE` without --size on a file that exists takes the
/// file's size, as for a block device (before, it asked for --size); what the
/// file holds still decides whether it may be formatted: data needs --force,
/// and a file too small names the size it needs.
#[test]
fn create_on_an_existing_file_takes_its_size() {
    let dir = TempDir::new("cli-size");
    // `pool create` of llama3-8b on `path`, no --size.
    let create_unsized = |path: &std::path::Path, extra: &[&str]| {
        let mut args = vec!["pool", "create", "--dev", path.to_str().unwrap()];
        args.extend_from_slice(&["--model", "llama3-8b"]);
        args.extend_from_slice(extra);
        kvtier(&args)
    };
    let sized = |name: &str, len: u64| {
        let f = dir.file(name);
        std::fs::File::create(&f).unwrap().set_len(len).unwrap();
        f
    };
    let f = sized("made.pool", 300 << 20);
    let (code, text) = create_unsized(&f, &["--group-blocks", "16"]);
    assert_eq!(code, 0, "{text}");
    assert_eq!(std::fs::metadata(&f).unwrap().len(), 300 << 20);
    let (code, text) = kvtier(&["pool", "info", "--json", "--dev", f.to_str().unwrap()]);
    assert_eq!(code, 0, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(v["capacity_bytes"].as_u64().unwrap() > 0, "{v}");
    // A file with data: refused without --force, and left as it was.
    let data = dir.file("data");
    std::fs::write(&data, vec![1u8; 300 << 20]).unwrap();
    let (code, text) = create_unsized(&data, &[]);
    assert_ne!(code, 0);
    assert!(text.contains("--force"), "{text}");
    assert!(std::fs::read(&data).unwrap().iter().all(|&b| b == 1));
    // Too small for one group of llama3-8b: says what it needs.
    let (code, text) = create_unsized(&sized("small", 1 << 20), &[]);
    assert_ne!(code, 0);
    assert!(
        text.contains("at least") && text.contains("--size"),
        "{text}"
    );
}

/// Control characters from arguments, configs and superblocks never reach
/// the terminal raw: each message escapes them (`\u001b`), clap's own
/// refusals included. Before, an ESC sequence in any of them was printed as
/// is (a forged pool could clear the screen of whoever ran `pool info`).
#[test]
fn control_characters_are_escaped_in_every_message() {
    let dir = TempDir::new("escapes");
    let esc = "\u{1b}[2J\u{9b}31m";
    let raw = |text: &str| text.chars().any(|c| c == '\u{1b}' || c == '\u{9b}');
    let escaped = |text: &str| {
        text.contains("\\u001b") || text.contains("\\u{1b}") || text.contains("\\u009b")
    };
    // An argument, refused by kvtier and by clap.
    for args in [
        vec!["bench", "--pattern", esc],
        vec!["pool", "create", "--dev", "x", "--block-size", esc],
        vec!["pool", "info", "--dev", esc],
    ] {
        let (code, text) = kvtier(&args);
        assert_ne!(code, 0, "{args:?}");
        assert!(!raw(&text) && escaped(&text), "{args:?}: {text}");
    }
    // A config's value quoted in its refusal.
    let cfg = dir.file("config.json");
    std::fs::write(
        &cfg,
        r#"{"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 2,
            "torch_dtype": "\u001b[2Jbf16"}"#,
    )
    .unwrap();
    let (code, text) = create(&dir.file("p.pool"), "64m", cfg.to_str().unwrap(), &[]);
    assert_ne!(code, 0);
    assert!(!raw(&text) && escaped(&text), "{text}");
    // A superblock's model name (forged, resealed) in `pool info`.
    let paths = stored_pool(&dir, 1);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&paths[0])
        .unwrap();
    let mut b = [0u8; 512];
    f.read_exact_at(&mut b, 0).unwrap();
    let mut sb: kvtier::pool::layout::Superblock = bytemuck::pod_read_unaligned(&b);
    sb.model[..esc.len()].copy_from_slice(esc.as_bytes());
    sb.model_len = esc.len() as u32;
    sb.seal();
    f.write_all_at(bytemuck::bytes_of(&sb), 0).unwrap();
    drop(f);
    let (code, text) = kvtier(&["pool", "info", "--dev", paths[0].to_str().unwrap()]);
    assert_eq!(code, 0, "{text}");
    assert!(!raw(&text) && escaped(&text), "{text}");
}

/// `--model DIR` names a Hugging Face model directory (its config.json),
/// also as a bare name in the working directory, and a config.json that
/// begins with a UTF-8 byte-order mark is read like any other. Before, the
/// bare directory was "an unknown preset" and the BOM a JSON syntax error.
#[test]
fn a_model_directory_and_a_config_with_a_bom_are_accepted() {
    let dir = TempDir::new("modeldir");
    let model = dir.file("My-Model");
    std::fs::create_dir(&model).unwrap();
    let config = r#"{"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 2,
        "num_key_value_heads": 2, "torch_dtype": "bfloat16"}"#;
    std::fs::write(model.join("config.json"), format!("\u{feff}{config}")).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .current_dir(dir.path())
        .args(["pool", "create", "--dev", "p.pool", "--size", "64m"])
        .args(["--model", "My-Model", "--block-size", "16"])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    let (code, text) = kvtier(&[
        "pool",
        "info",
        "--dev",
        dir.file("p.pool").to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("2 layers"), "{text}");
}

/// `pool create --dir` makes the pool the library's TierBuilder opens in
/// that directory (same files, capacity split, namespace), `info` and
/// `check` find it by directory, and the policy's refusals are said in the
/// CLI's words.
#[test]
fn a_pool_directory_made_by_the_cli_is_the_one_the_builder_opens() {
    use kvtier::handle::{EngineChoice, TierBuilder};
    use kvtier::pool::place::CreateMode;
    let dir = TempDir::new("cli-dir");
    let cfg = tiny_config(&dir);
    let pool_dir = dir.file("kv");
    let d = pool_dir.to_str().unwrap();
    let m = cfg.to_str().unwrap();
    // `pool create --dir DIR --model M` and more.
    let create_in = |dir: &str, extra: &[&str]| {
        let mut args = vec!["pool", "create", "--dir", dir, "--model", m];
        args.extend_from_slice(extra);
        kvtier(&args)
    };
    let (code, text) = create_in(d, &["--files", "2", "--capacity", "64m"]);
    assert_eq!(code, 0, "{text}");
    for i in 0..2 {
        let f = pool_dir.join(format!("kvtier-{i}.pool"));
        assert_eq!(std::fs::metadata(&f).unwrap().len(), 32 << 20);
    }
    let (code, text) = kvtier(&["pool", "info", "--json", "--dir", d, "--files", "2"]);
    assert_eq!(code, 0, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["devices"].as_array().unwrap().len(), 2);
    // Without --files: the files that are there (it said "the pool has 2
    // device(s) but 1 were named").
    let (code, text) = kvtier(&["pool", "info", "--json", "--dir", d]);
    assert_eq!(code, 0, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["devices"].as_array().unwrap().len(), 2);
    // The builder opens it (open only: nothing is created), for the same
    // model's namespace, and stores into it.
    let named = kvtier::model::resolve_named(m, 16, None).unwrap();
    let cache = Arc::new(HostKvCache::new(named.geometry, 4, HostLayout::PerLayer).unwrap());
    let h = TierBuilder::default()
        .directory(&pool_dir)
        .directory_files(2)
        .model(named)
        .create_mode(CreateMode::Never)
        .engine(EngineChoice::Uring)
        .host_cache(cache.clone())
        .build()
        .unwrap();
    cache.fill_block(0, seed_of(7));
    let r = h
        .wait(h.submit_store(&[Key::from_u64(7)], &[0]).unwrap())
        .unwrap();
    assert!(r.all_ok());
    h.close().unwrap();
    let (code, text) = kvtier(&["pool", "check", "--dir", d, "--files", "2"]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("1 live block(s) checked, 1 ok"), "{text}");
    // The builder finds the count too, and the key stored above.
    let named = kvtier::model::resolve_named(m, 16, None).unwrap();
    let cache = Arc::new(HostKvCache::new(named.geometry, 4, HostLayout::PerLayer).unwrap());
    let h = TierBuilder::default()
        .directory(&pool_dir)
        .model(named)
        .create_mode(CreateMode::Never)
        .engine(EngineChoice::Uring)
        .host_cache(cache)
        .build()
        .unwrap();
    assert_eq!(h.lookup_prefix(&[Key::from_u64(7)]), 1);
    h.close().unwrap();
    // Too little capacity: the CLI's words, nothing made.
    let small = dir.file("small");
    let (code, text) = create_in(small.to_str().unwrap(), &["--capacity", "1m"]);
    assert_ne!(code, 0);
    assert!(text.contains("give a capacity of at least"), "{text}");
    assert!(!small.exists(), "nothing made for a refused create");
    // --dir without --capacity, and --size beside --dir, are refused.
    let (code, text) = create_in(d, &[]);
    assert!(code != 0 && text.contains("--capacity"), "{text}");
    let (code, text) = create_in(d, &["--capacity", "64m", "--size", "1g"]);
    assert!(code != 0 && text.contains("--size"), "{text}");
    // Over the existing pool: refused without --force, as for --dev.
    let (code, text) = create_in(d, &["--files", "2", "--capacity", "64m"]);
    assert!(code != 0 && text.contains("--force"), "{text}");
    // Made again over one file: the pool is that file, whatever earlier
    // pool's file is left beside it.
    let (code, text) = create_in(d, &["--files", "1", "--capacity", "64m", "--force"]);
    assert_eq!(code, 0, "{text}");
    let (code, text) = kvtier(&["pool", "info", "--json", "--dir", d]);
    assert_eq!(code, 0, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["devices"].as_array().unwrap().len(), 1);
}

/// A newcomer reads `--help`: every option of every subcommand says what it
/// does (a flag listed with nothing, or only its default, beside it tells
/// nothing). Clap puts a description on the option's line, or on the lines
/// below it when the help is long.
#[test]
fn every_option_in_every_help_says_what_it_does() {
    let commands: [&[&str]; 10] = [
        &["pool", "create"],
        &["pool", "info"],
        &["pool", "check"],
        &["bench"],
        &["replay"],
        &["doctor"],
        &["nvme", "list"],
        &["nvme", "bind"],
        &["serve"],
        &[],
    ];
    let is_option = |l: &str| {
        let t = l.trim_start();
        let indent = l.len() - t.len();
        (2..=6).contains(&indent) && (t.starts_with("--") || t.starts_with("-h, --"))
    };
    let mut bare = Vec::new();
    for cmd in commands {
        let mut args = cmd.to_vec();
        args.push("--help");
        let (code, text) = kvtier(&args);
        assert_eq!(code, 0, "{args:?}: {text}");
        let lines: Vec<&str> = text.lines().collect();
        for (i, l) in lines.iter().enumerate() {
            if !is_option(l) {
                continue;
            }
            // The option and its value name, then two or more spaces and
            // the description; or the description on the lines below.
            let t = l.trim();
            let mut desc = match t.find("  ") {
                Some(at) => t[at..].trim().to_string(),
                None => String::new(),
            };
            for next in &lines[i + 1..] {
                if !next.starts_with("          ") || is_option(next) {
                    break;
                }
                desc.push(' ');
                desc.push_str(next.trim());
            }
            let words: String = desc
                .split('[')
                .next()
                .unwrap_or_default()
                .trim()
                .to_string();
            if words.is_empty() {
                bare.push(format!("kvtier {} {}", cmd.join(" "), t));
            }
        }
    }
    assert!(bare.is_empty(), "options without a description: {bare:#?}");
}

//! The fuzz targets' entry points (kvtier::fuzzing), run on stable Rust for
//! a few seconds each with a fixed seed: random and mutated bytes (from the
//! checked-in corpus under fuzz/corpus/) through the superblock decoder,
//! the block-header decoder, config.json parsing and slack-table loading.
//! Each input must be accepted or refused with a short message, quickly,
//! without a panic and without an allocation the input does not justify
//! (the process runs under an address-space limit, so one fails here
//! instead of exhausting the machine).

use kvtier::fuzzing;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Once;
use std::time::{Duration, Instant};

/// splitmix64: deterministic, so a failure reproduces from its iteration.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

/// Values that break arithmetic: zero, one, signed and unsigned extremes.
const INTERESTING: [u64; 12] = [
    0,
    1,
    2,
    0x7f,
    0x80,
    0xff,
    0xffff,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    0x7fff_ffff_ffff_ffff,
    u64::MAX,
];

fn limit_address_space() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let lim = libc::rlimit {
            rlim_cur: 6 << 30,
            rlim_max: 6 << 30,
        };
        // SAFETY: setrlimit on our own process with a valid struct.
        unsafe { libc::setrlimit(libc::RLIMIT_AS, &lim) };
    });
}

/// Byte-level mutations, as libFuzzer's do.
fn mutate_bytes(rng: &mut Rng, seed: &[u8]) -> Vec<u8> {
    let mut b = seed.to_vec();
    for _ in 0..1 + rng.below(8) {
        let len = b.len();
        match rng.below(8) {
            0 if len > 0 => {
                let i = rng.below(len);
                b[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                b[i] = INTERESTING[rng.below(INTERESTING.len())] as u8;
            }
            2 if len >= 8 => {
                // A little-endian u32 or u64 set to an extreme, aligned as
                // struct fields are.
                let wide = rng.chance(50);
                let w = if wide { 8 } else { 4 };
                let i = rng.below(len / w) * w;
                let v = INTERESTING[rng.below(INTERESTING.len())];
                b[i..i + w].copy_from_slice(&v.to_le_bytes()[..w]);
            }
            3 if len > 0 => {
                let at = rng.below(len);
                let n = rng.below(len - at + 1);
                b.drain(at..at + n);
            }
            4 => {
                let at = rng.below(len + 1);
                let n = rng.below(64);
                let fill = rng.next() as u8;
                b.splice(at..at, std::iter::repeat_n(fill, n));
            }
            5 if len > 0 => {
                let from = rng.below(len);
                let n = rng.below(len - from + 1).min(256);
                let chunk = b[from..from + n].to_vec();
                let at = rng.below(len + 1);
                b.splice(at..at, chunk);
            }
            6 => b.truncate(rng.below(len + 1)),
            _ => {
                let n = rng.below(512);
                b = (0..n).map(|_| rng.next() as u8).collect();
            }
        }
    }
    b
}

/// Structure-aware JSON mutations: one value somewhere in the document
/// replaced by something hostile.
fn mutate_json(rng: &mut Rng, v: &mut Value, depth: u32) {
    let replace = depth > 6 || rng.chance(30);
    match v {
        Value::Object(m) if !replace && !m.is_empty() => {
            let keys: Vec<String> = m.keys().cloned().collect();
            let k = &keys[rng.below(keys.len())];
            if rng.chance(10) {
                m.remove(k);
            } else {
                mutate_json(rng, m.get_mut(k).expect("a key of m"), depth + 1);
            }
        }
        Value::Array(a) if !replace && !a.is_empty() => {
            let i = rng.below(a.len());
            if rng.chance(10) {
                a.remove(i);
            } else if rng.chance(10) {
                let x = a[i].clone();
                a.insert(i, x);
            } else {
                mutate_json(rng, &mut a[i], depth + 1);
            }
        }
        _ => *v = hostile(rng),
    }
}

fn hostile(rng: &mut Rng) -> Value {
    match rng.below(14) {
        0 => Value::Null,
        1 => (rng.next() as i64).into(),
        2 => INTERESTING[rng.below(INTERESTING.len())].into(),
        3 => (-(rng.below(1000) as i64) - 1).into(),
        4 => serde_json::json!(1e300),
        5 => serde_json::json!(-1e-300),
        6 => serde_json::json!(0.5),
        7 => "x".repeat(rng.below(30_000)).into(),
        8 => Value::Array((0..rng.below(20_000) as u64).map(Value::from).collect()),
        9 => serde_json::json!({}),
        10 => serde_json::json!([]),
        11 => Value::Bool(rng.chance(50)),
        12 => "bfloat16".into(),
        _ => (rng.below(70_000) as u64).into(),
    }
}

fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut v: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| {
            let p = e.unwrap().path();
            let b = std::fs::read(&p).unwrap();
            (p, b)
        })
        .collect();
    v.sort();
    assert!(!v.is_empty(), "no seeds in {}", dir.display());
    v
}

/// Runs `decode` on `input` and checks what any decoder must do.
fn check(what: &str, iteration: usize, input: &[u8], decode: fn(&[u8]) -> Option<String>) {
    let t = Instant::now();
    let outcome = std::panic::catch_unwind(|| decode(input));
    let took = t.elapsed();
    let keep = || {
        // Keep the failing input for replay with the fuzz target.
        let p = std::env::temp_dir().join(format!("kvtier-fuzz-{what}-{iteration}.bin"));
        let _ = std::fs::write(&p, input);
        p.display().to_string()
    };
    match outcome {
        Err(_) => panic!(
            "{what}: iteration {iteration} panicked; input in {}",
            keep()
        ),
        Ok(Some(msg)) => assert!(
            msg.len() < 1500,
            "{what}: iteration {iteration}: a {}-byte error message (input in {}): {}...",
            msg.len(),
            keep(),
            &msg[..300.min(msg.len())]
        ),
        Ok(None) => {}
    }
    assert!(
        took < Duration::from_secs(5),
        "{what}: iteration {iteration} took {took:?}; input in {}",
        keep()
    );
}

fn run_json_target(what: &str, seed: u64, iterations: usize, decode: fn(&[u8]) -> Option<String>) {
    limit_address_space();
    let seeds = corpus(what);
    let mut rng = Rng(seed);
    for (p, s) in &seeds {
        assert!(
            decode(s).is_none(),
            "seed {} is refused: {:?}",
            p.display(),
            decode(s)
        );
    }
    let parsed: Vec<Value> = seeds
        .iter()
        .map(|(_, s)| serde_json::from_slice(s).unwrap())
        .collect();
    for i in 0..iterations {
        let k = rng.below(seeds.len());
        let input = if rng.chance(60) {
            let mut v = parsed[k].clone();
            for _ in 0..1 + rng.below(3) {
                mutate_json(&mut rng, &mut v, 0);
            }
            v.to_string().into_bytes()
        } else {
            mutate_bytes(&mut rng, &seeds[k].1)
        };
        check(what, i, &input, decode);
    }
}

#[test]
fn config_json_survives_random_and_mutated_input() {
    run_json_target("config_json", 0xC0F1, 3000, fuzzing::config_json);
}

#[test]
fn slack_table_survives_random_and_mutated_input() {
    run_json_target("slack_table", 0x51AC, 1500, fuzzing::slack_table);
}

#[test]
fn block_headers_survive_random_and_mutated_input() {
    limit_address_space();
    let seeds = corpus("block_headers");
    let mut rng = Rng(0xB10C);
    for i in 0..2000 {
        let base = &seeds[rng.below(seeds.len())].1;
        let mut input = mutate_bytes(&mut rng, base);
        // Most records get repairs, so they reach the deeper checks.
        for rec in input.chunks_mut(129) {
            if rng.chance(70) {
                rec[0] |= (rng.next() as u8) | 0x03;
            }
        }
        check("block_headers", i, &input, fuzzing::block_headers);
    }
}

#[test]
fn unsealed_superblocks_are_refused() {
    limit_address_space();
    let seeds = corpus("superblock");
    let mut rng = Rng(0x5B01);
    for i in 0..3000 {
        let base = &seeds[rng.below(seeds.len())].1;
        let mut input = mutate_bytes(&mut rng, base);
        if let Some(f) = input.first_mut() {
            *f &= !8;
        }
        check("superblock", i, &input, fuzzing::superblock);
    }
}

/// A forger who reseals the checksum: every field of a valid superblock
/// set to extremes (groups 0xFFFFFFFF, group size 0xFFFFFFFF, zero
/// layers or block size, groups past the end of the device). Each must be
/// refused by name or opened within bounds.
#[test]
fn forged_superblocks_are_refused_or_bounded() {
    limit_address_space();
    let seeds = corpus("superblock");
    let mut rng = Rng(0xF0F0);
    for i in 0..3000 {
        let base = &seeds[rng.below(seeds.len())].1;
        let mut input = mutate_bytes(&mut rng, base);
        if input.is_empty() {
            continue;
        }
        input[0] |= 8 | (rng.next() as u8 & 7);
        assert!(fuzzing::superblock_is_sealed(&input));
        check("superblock", i, &input, fuzzing::superblock);
    }
}

/// The checked-in seeds that are binary: regenerate with
/// `cargo test --test fuzz_decoders -- --ignored write_binary_seeds`.
#[test]
#[ignore = "writes fuzz/corpus; run by hand when the on-disk format changes"]
fn write_binary_seeds() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    // Superblock: no repairs, the valid superblock as written by format.
    let mut sb = vec![0u8];
    sb.extend_from_slice(&fuzzing::valid_superblock());
    std::fs::write(root.join("superblock/valid.bin"), &sb).unwrap();
    // Block headers: four live headers with keys, every repair on; the
    // rest of the slots untouched.
    let mut recs = Vec::new();
    for slot in 0..4u64 {
        recs.push(0x1f);
        let mut h = [0u8; 128];
        // key at offset 40, key_len at 72
        h[40..48].copy_from_slice(&(1000 + slot).to_le_bytes());
        h[72] = 8;
        // generation at 32
        h[32..40].copy_from_slice(&(slot + 1).to_le_bytes());
        recs.extend_from_slice(&h);
    }
    std::fs::write(root.join("block_headers/live.bin"), &recs).unwrap();
    assert_eq!(fuzzing::block_headers(&recs), None, "the seed pool opens");
}

#[test]
fn binary_seeds_decode() {
    // The seeds are accepted, so mutations start from inputs that reach
    // every check.
    for target in ["superblock", "block_headers"] {
        for (p, s) in corpus(target) {
            let decode = if target == "superblock" {
                fuzzing::superblock
            } else {
                fuzzing::block_headers
            };
            assert_eq!(decode(&s), None, "{}", p.display());
        }
    }
}

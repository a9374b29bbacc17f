//! Slack tables: every table in tables/ loads and fits its model; malformed
//! tables are refused with the file and the field named; lookups between grid
//! points interpolate and outside the grid clamp.

use kvtier::model;
use kvtier::slack::{Mode, SlackTable};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn tables_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tables")
}

fn table_files() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(tables_dir())
        .expect("tables/ exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    v.sort();
    v
}

fn llama() -> SlackTable {
    SlackTable::load(tables_dir().join("llama3-8b.h100.json")).unwrap()
}

/// A scratch file removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn write(tag: &str, text: &str) -> Scratch {
        let p = std::env::temp_dir().join(format!(
            "kvtier-slack-{tag}-{}-{}.json",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        std::fs::write(&p, text).unwrap();
        Scratch(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The llama3-8b table edited by `f`, loaded from a file: the error message.
fn load_edited(tag: &str, f: impl FnOnce(&mut Value)) -> String {
    let text = std::fs::read_to_string(tables_dir().join("llama3-8b.h100.json")).unwrap();
    let mut v: Value = serde_json::from_str(&text).unwrap();
    f(&mut v);
    let file = Scratch::write(tag, &v.to_string());
    let msg = SlackTable::load(&file.0)
        .expect_err("a malformed table must be refused")
        .to_string();
    let path = file.0.display().to_string();
    assert!(msg.starts_with(&format!("{path}: ")), "{msg}");
    msg
}

#[test]
fn every_table_loads_and_fits_its_model() {
    let files = table_files();
    for model in ["llama3-8b", "llama3-70b", "qwen3-32b", "glm4-9b"] {
        for gpu in ["h100", "h200"] {
            let want = tables_dir().join(format!("{model}.{gpu}.json"));
            assert!(files.contains(&want), "{} is missing", want.display());
        }
    }
    for f in &files {
        let t = SlackTable::load(f).unwrap_or_else(|e| panic!("{e}"));
        let name = &t.model().name;
        assert!(
            f.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with(&format!("{name}.")),
            "{} holds model {name}",
            f.display()
        );
        let g = model::preset(name, t.model().block_size).unwrap();
        t.check_geometry(&g).unwrap();
        assert_eq!(t.layers(), g.layers);
        if t.mode() == Mode::Analytic {
            assert!(t.estimated());
        }
        let p = t.provenance();
        assert!(p.command.starts_with("kvtier-profile "), "{}", p.command);
        assert!(!p.machine.is_empty() && !p.kernel.is_empty() && !p.kvtier_version.is_empty());
        assert!(
            t.storage().source.starts_with("assumed")
                || t.storage().source.starts_with("measured on ")
        );
        // Analytic tables span 8 x 8 points; measured ones a smaller grid.
        let (ni, np) = (t.input_lengths().len(), t.prefix_lengths().len());
        assert!(ni >= 2 && np >= 2, "{}: a {ni} x {np} grid", f.display());
        if t.mode() == Mode::Analytic {
            assert_eq!((ni, np), (8, 8));
        }
        // Reading more prefix takes longer; more input computes longer.
        for i in 0..ni {
            for p in 1..np {
                let (a, b) = (t.entry(i, p - 1), t.entry(i, p));
                assert!(b.layers[0].read_us > a.layers[0].read_us);
                assert!(b.layers[0].compute_us >= a.layers[0].compute_us);
            }
        }
        for p in 0..np {
            for i in 1..ni {
                let (a, b) = (t.entry(i - 1, p), t.entry(i, p));
                assert!(b.layers[0].compute_us > a.layers[0].compute_us);
            }
        }
        let d = &t.file().decode;
        assert!(d.windows(2).all(|w| w[1].step_us >= w[0].step_us));
    }
    // The same model decodes faster on H200's HBM.
    let h100 = llama();
    let h200 = SlackTable::load(tables_dir().join("llama3-8b.h200.json")).unwrap();
    assert!(h200.decode(4096).step_us < h100.decode(4096).step_us);
}

#[test]
fn negative_time_names_file_and_field() {
    let msg = load_edited("negative", |v| {
        v["entries"][3]["layers"][7]["compute_us"] = (-1.0).into()
    });
    assert!(
        msg.contains(": entries[3].layers[7].compute_us is negative (-1.0)"),
        "{msg}"
    );
}

#[test]
fn wrong_schema_is_refused() {
    let msg = load_edited("schema", |v| v["schema"] = "kvtier-slack/0".into());
    assert!(
        msg.contains("schema is \"kvtier-slack/0\", not \"kvtier-slack/1\""),
        "{msg}"
    );
}

#[test]
fn layer_count_must_be_the_models() {
    let msg = load_edited("layers", |v| {
        v["entries"][10]["layers"]
            .as_array_mut()
            .unwrap()
            .truncate(31)
    });
    assert!(
        msg.contains("entries[10].layers has 31 rows but model.layers is 32"),
        "{msg}"
    );
    // Changing the model's layer count instead refuses every entry.
    let msg = load_edited("model-layers", |v| v["model"]["layers"] = 80.into());
    assert!(
        msg.contains("entries[0].layers has 32 rows but model.layers is 80"),
        "{msg}"
    );
}

#[test]
fn grid_must_be_strictly_increasing() {
    let msg = load_edited("grid", |v| {
        v["input_lengths"][4] = 2048.into();
    });
    assert!(
        msg.contains("input_lengths is not strictly increasing: input_lengths[4] is 2048 after input_lengths[3] = 4096"),
        "{msg}"
    );
}

#[test]
fn missing_grid_point_is_named() {
    let msg = load_edited("missing", |v| {
        v["entries"].as_array_mut().unwrap().remove(9);
    });
    assert!(
        msg.contains("entries has no entry for grid point (input 1024, prefix 2048)"),
        "{msg}"
    );
}

#[test]
fn missing_and_unknown_fields_are_named() {
    let msg = load_edited("field", |v| {
        v["decode"][2].as_object_mut().unwrap().remove("step_us");
    });
    assert!(msg.contains("decode[2].step_us is missing"), "{msg}");
    let msg = load_edited("unknown", |v| {
        v["storage"]["read_gbps"] = 7.into();
    });
    assert!(
        msg.contains("storage.read_gbps is not a field of a kvtier-slack/1 table"),
        "{msg}"
    );
}

#[test]
fn unreadable_file_is_named() {
    let msg = SlackTable::load("/nonexistent/kvtier/t.json")
        .err()
        .unwrap()
        .to_string();
    assert!(
        msg.starts_with("/nonexistent/kvtier/t.json: cannot read the slack table"),
        "{msg}"
    );
}

#[test]
fn interpolation_between_grid_points() {
    let t = llama();
    // input 768 is halfway between 512 and 1024, prefix 3072 between 2048 and 4096.
    let s = t.layer(768, 3072, 0).unwrap();
    let c = |i: usize, p: usize| t.entry(i, p).layers[0].compute_us;
    let want = (c(0, 1) + c(0, 2) + c(1, 1) + c(1, 2)) / 4.0;
    assert!((s.compute_us - want).abs() < 1e-6, "{s:?} vs {want}");
    let r = |p: usize| t.entry(0, p).layers[0].read_us;
    assert!((s.read_us - (r(1) + r(2)) / 2.0).abs() < 1e-6);
    assert!((s.slack_us - (s.compute_us - s.read_us)).abs() < 0.01);
    // 3072 prefix tokens = 192 blocks = 384 objects: one read IOCB.
    assert_eq!(s.read_iocbs, 1);
    assert!((2..=8).contains(&s.sm_budget));
    // At a grid point the row itself.
    let g = t.layer(4096, 8192, 31).unwrap();
    let row = t.entry(3, 3).layers[31];
    assert_eq!(
        (
            g.compute_us,
            g.read_us,
            g.slack_us,
            g.write_iocbs,
            g.sm_budget
        ),
        (
            row.compute_us,
            row.read_us,
            row.slack_us,
            row.write_iocbs,
            row.sm_budget
        )
    );
    assert_eq!(t.prefill(4096, 8192).len(), 32);
    assert!(t.layer(4096, 8192, 32).is_err());
}

#[test]
fn clamping_outside_the_grid() {
    let t = llama();
    assert!(!t.covers(100, 0) && !t.covers(512, 1 << 20) && t.covers(512, 0));
    let below = t.layer(1, 0, 0).unwrap();
    assert_eq!(below.compute_us, t.entry(0, 0).layers[0].compute_us);
    let above = t.layer(1 << 20, 1 << 20, 0).unwrap();
    let edge = t.entry(7, 7).layers[0];
    assert_eq!(
        (above.compute_us, above.read_us, above.read_iocbs),
        (edge.compute_us, edge.read_us, edge.read_iocbs)
    );
    let d = t.decode(1);
    assert_eq!((d.context, d.step_us), (1024, t.file().decode[0].step_us));
    let d = t.decode(1 << 30);
    assert_eq!(d.context, 131072);
    let mid = t.decode(1536);
    let (a, b) = (&t.file().decode[0], &t.file().decode[1]);
    assert!((mid.step_us - (a.step_us + b.step_us) / 2.0).abs() < 1e-6);
}

#[test]
fn table_for_another_model_is_refused() {
    let t = llama();
    let g = model::preset("glm4-9b", 16).unwrap();
    let msg = t.check_geometry(&g).unwrap_err().to_string();
    assert!(msg.contains("llama3-8b.h100.json"), "{msg}");
    assert!(msg.contains("layers 32 (table) vs 40"), "{msg}");
    assert!(msg.contains("kv_heads 8 (table) vs 2"), "{msg}");
    let g = model::preset("llama3-8b", 32).unwrap();
    let msg = t.check_geometry(&g).unwrap_err().to_string();
    assert!(msg.contains("block_size 16 (table) vs 32"), "{msg}");
}

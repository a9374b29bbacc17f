use super::*;

/// A 2-layer llama-shaped model: objects of 32 KiB.
fn header() -> TableHeader {
    TableHeader {
        model: ModelInfo {
            name: "tiny".into(),
            layers: 2,
            kv_heads: 8,
            head_dim: 128,
            dtype: "bfloat16".into(),
            block_size: 16,
            hidden_size: 4096,
            intermediate_size: 14336,
            attention_heads: 32,
        },
        gpu: GpuInfo {
            name: "H100-SXM".into(),
            sms: 132,
            bf16_tflops: 989.0,
            hbm_gbs: 3350.0,
        },
        storage: StorageInfo {
            read_gbs: 8.0,
            write_gbs: 4.0,
            iocb_service_us: 80.0,
            source: "assumed: test".into(),
        },
        mode: Mode::Analytic,
        estimated: true,
        provenance: Provenance {
            machine: "test".into(),
            kernel: "6.1".into(),
            kvtier_version: "0.1.0".into(),
            date: "2025-01-31".into(),
            command: "kvtier-profile --model tiny".into(),
            method: "test".into(),
        },
    }
}

/// Grid inputs [1024, 4096], prefixes [0, 2048, 8192]; compute of layer l at
/// (input, prefix) = input/10 + prefix/100 + l (µs).
fn tiny() -> SlackTable {
    let inputs = vec![1024, 4096];
    let prefixes = vec![0, 2048, 8192];
    let mut compute = Vec::new();
    for &i in &inputs {
        for &p in &prefixes {
            compute.push(
                (0..2)
                    .map(|l| i as f64 / 10.0 + p as f64 / 100.0 + l as f64)
                    .collect(),
            );
        }
    }
    SlackTable::build(
        header(),
        inputs,
        prefixes,
        &compute,
        &[(1024, 3000.0), (4096, 5000.0)],
        "tiny.json",
    )
    .unwrap()
}

fn edit(f: impl FnOnce(&mut Value)) -> String {
    let mut v: Value = serde_json::from_str(&tiny().to_json_string()).unwrap();
    f(&mut v);
    v.to_string()
}

fn rejected(text: &str) -> String {
    match SlackTable::from_json_str(text, "tables/x.json") {
        Ok(_) => panic!("expected an error"),
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.starts_with("tables/x.json: "), "{msg}");
            msg
        }
    }
}

#[test]
fn round_trip_and_serde_agree() {
    let t = tiny();
    let text = t.to_json_string();
    let back = SlackTable::from_json_str(&text, "t").unwrap();
    assert_eq!(back.file(), t.file());
    // The shape check and serde's derive describe the same fields.
    let direct: TableFile = serde_json::from_str(&text).unwrap();
    assert_eq!(&direct, t.file());
    let v: Value = serde_json::from_str(&text).unwrap();
    check_shape(&v, TABLE_TY, "", "t").unwrap();
}

#[test]
fn derived_columns() {
    let t = tiny();
    let g = t.geometry();
    assert_eq!(g.object_bytes(), 32768);
    // prefix 2048 tokens = 128 blocks = 256 objects x 32 KiB = 8 MiB at 8 GB/s.
    let r = t.entry(0, 1).layers[0];
    assert_eq!(r.read_us, round_us(8_388_608.0 / 8e3));
    assert_eq!(r.compute_us, round_us(102.4 + 20.48));
    assert_eq!(r.slack_us, round_us(r.compute_us - r.read_us));
    assert_eq!(r.read_iocbs, 1);
    assert_eq!(r.write_iocbs, 0);
    assert_eq!(r.sm_budget, 8);
    // No prefix: nothing to read, all compute is slack; input 1024 =
    // 64 blocks = 128 objects = 4 MiB at 4 GB/s = 1048.576 µs > 102.4 µs.
    let r = t.entry(0, 0).layers[0];
    assert_eq!((r.read_us, r.read_iocbs, r.write_iocbs), (0.0, 0, 0));
    assert_eq!(r.sm_budget, SM_BUDGET_MIN);
    // 8192-token prefix: 1024 objects, still one IOCB.
    assert_eq!(read_iocbs(&g, 8192), 1);
    assert_eq!(read_iocbs(&g, 16384), 1);
    assert_eq!(read_iocbs(&g, 16385), 2);
    assert_eq!(read_iocbs(&g, 131072), 8);
}

#[test]
fn write_fit_and_sm_rules() {
    let g = tiny().geometry();
    // 4096 input tokens = 512 objects = 16 MiB: 4194.304 µs at 4 GB/s.
    assert_eq!(write_iocbs_fit(&g, 4.0, 4096, 4194.0), (0, 0.0));
    assert_eq!(write_iocbs_fit(&g, 4.0, 4096, 4194.4).0, 1);
    assert_eq!(write_iocbs_fit(&g, 4.0, 4096, -5.0).0, 0);
    // 65536 tokens = 8192 objects = 4 full IOCBs of 64 MiB, 16777.216 µs each.
    let full = full_iocb_write_us(&g, 4.0);
    assert!((full - 16777.216).abs() < 1e-6);
    assert_eq!(write_iocbs_fit(&g, 4.0, 65536, full * 2.5).0, 2);
    assert_eq!(write_iocbs_fit(&g, 4.0, 65536, full * 10.0).0, 4);
    assert_eq!(full_write_iocbs_fit(&g, 4.0, full * 3.99), 3);
    assert_eq!(full_write_iocbs_fit(&g, 4.0, -1.0), 0);
    assert_eq!(sm_budget_max(132), 8);
    assert_eq!(sm_budget_max(16), 2);
    assert_eq!(sm_budget(132, 100.0, 0.0), 2);
    assert_eq!(sm_budget(132, 100.0, 30.0), 3);
    assert_eq!(sm_budget(132, 100.0, 500.0), 8);
    assert_eq!(sm_budget(132, 0.0, 1.0), 8);
    assert_eq!(sm_budget(132, 0.0, 0.0), 2);
}

#[test]
fn lookup_at_grid_points_is_the_row() {
    let t = tiny();
    for (i, &input) in t.input_lengths().iter().enumerate() {
        for (p, &prefix) in t.prefix_lengths().iter().enumerate() {
            for l in 0..2 {
                let row = t.entry(i, p).layers[l as usize];
                let s = t.layer(input, prefix, l).unwrap();
                assert_eq!(
                    (
                        s.compute_us,
                        s.read_us,
                        s.slack_us,
                        s.sm_budget,
                        s.read_iocbs,
                        s.write_iocbs
                    ),
                    (
                        row.compute_us,
                        row.read_us,
                        row.slack_us,
                        row.sm_budget,
                        row.read_iocbs,
                        row.write_iocbs
                    )
                );
            }
        }
    }
    let d = t.decode(4096);
    assert_eq!(
        (d.step_us, d.slack_us, d.write_iocbs, d.sm_budget),
        (
            t.file().decode[1].step_us,
            t.file().decode[1].slack_us,
            t.file().decode[1].write_iocbs,
            t.file().decode[1].sm_budget
        )
    );
}

#[test]
fn bilinear_inside_clamped_outside() {
    let t = tiny();
    // Compute is linear in input and prefix here, so bilinear is exact.
    let s = t.layer(2560, 5120, 1).unwrap();
    assert!((s.compute_us - (256.0 + 51.2 + 1.0)).abs() < 1e-9, "{s:?}");
    // Read: halfway between 2048 (8 MiB) and 8192 (32 MiB) prefix tokens.
    let want_read = (read_us(&t.geometry(), 8.0, 2048) + read_us(&t.geometry(), 8.0, 8192)) / 2.0;
    assert!((s.read_us - want_read).abs() < 1e-9);
    assert!((s.slack_us - (s.compute_us - s.read_us)).abs() < 0.01);
    assert_eq!(s.read_iocbs, 1);
    // Outside: clamped to the nearest edge.
    let lo = t.layer(1, 0, 0).unwrap();
    assert_eq!(lo.compute_us, t.entry(0, 0).layers[0].compute_us);
    let hi = t.layer(1 << 20, 1 << 30, 0).unwrap();
    assert_eq!(hi.compute_us, t.entry(1, 2).layers[0].compute_us);
    assert_eq!(hi.read_iocbs, t.entry(1, 2).layers[0].read_iocbs);
    assert!(!t.covers(1, 0) && t.covers(1024, 0) && !t.covers(4096, 8193));
    // Half-way in input only.
    let m = t.layer(2560, 0, 0).unwrap();
    assert!((m.compute_us - 256.0).abs() < 1e-9);
    assert!(t.layer(1024, 0, 2).is_err());
    assert_eq!(t.prefill(2560, 5120).len(), 2);
    let total = t.prefill_compute_us(1024, 0);
    assert!((total - (102.4 + 103.4)).abs() < 1e-9);
}

#[test]
fn write_iocbs_floor_from_interpolated_slack() {
    // One layer of 4096-token input needs 4194.304 µs of writing (4 GB/s);
    // make the slack cross it between two grid points.
    let mut h = header();
    h.model.layers = 1;
    let t = SlackTable::build(
        h,
        vec![4096],
        vec![0, 1024],
        &[vec![4000.0], vec![6000.0]],
        &[(1, 10.0)],
        "x",
    )
    .unwrap();
    assert_eq!(t.entry(0, 0).layers[0].write_iocbs, 0);
    // prefix 1024: read 2 MiB at 8 GB/s = 262.144 µs; slack 5737.856: fits.
    assert_eq!(t.entry(0, 1).layers[0].write_iocbs, 1);
    // At prefix 128: compute 4250, read 65.536, slack 4184.464: below 4194.304, none fits.
    let s = t.layer(4096, 128, 0).unwrap();
    assert!(s.slack_us < 4194.304, "{s:?}");
    assert_eq!(s.write_iocbs, 0);
    // At prefix 256: compute 4500, read 131.072, slack 4368.928: one fits.
    let s = t.layer(4096, 256, 0).unwrap();
    assert!(s.slack_us > 4194.304, "{s:?}");
    assert_eq!(s.write_iocbs, 1);
}

#[test]
fn decode_interpolates_and_clamps() {
    let t = tiny();
    let own = decode_own_write_us(&t.geometry(), 4.0);
    // 2 layers x 2 x 8 heads x 128 x 2 B = 8 KiB per token at 4 GB/s.
    assert!((own - 2.048).abs() < 1e-9);
    let d = t.decode(2560);
    assert!((d.step_us - 4000.0).abs() < 1e-9);
    assert!((d.slack_us - (4000.0 - own)).abs() < 0.002);
    assert_eq!(d.context, 2560);
    let lo = t.decode(1);
    assert_eq!((lo.context, lo.step_us), (1024, 3000.0));
    let hi = t.decode(1 << 40);
    assert_eq!((hi.context, hi.step_us), (4096, 5000.0));
    // Full IOCB: 2048 x 32 KiB = 64 MiB at 4 GB/s = 16.8 ms: none fits in 5 ms.
    assert_eq!(hi.write_iocbs, 0);
    // ...but 5 ms of slack at 4 GB/s is ~20 MB of writes.
    assert_eq!(hi.write_budget_bytes, ((5000.0 - own) * 4e3).floor() as u64);
    let s = t.layer(1024, 0, 0).unwrap();
    assert_eq!(s.write_budget_bytes, (s.slack_us * 4e3).floor() as u64);
    let s = t.layer(1024, 8192, 0).unwrap();
    assert!(s.slack_us < 0.0);
    assert_eq!((s.write_budget_bytes, s.write_window_us()), (0, 0.0));
    assert_eq!(s.bubble_us(), -s.slack_us);
}

#[test]
fn check_geometry_names_the_difference() {
    let t = tiny();
    let mut g = t.geometry();
    t.check_geometry(&g).unwrap();
    g.block_size = 32;
    let msg = t.check_geometry(&g).unwrap_err().to_string();
    assert!(msg.contains("block_size 16 (table) vs 32"), "{msg}");
    assert!(msg.contains("tiny.json"), "{msg}");
    let g = crate::model::preset("llama3-8b", 16).unwrap();
    let msg = t.check_geometry(&g).unwrap_err().to_string();
    assert!(msg.contains("layers 2 (table) vs 32"), "{msg}");
}

#[test]
fn negative_time_is_named() {
    let text = edit(|v| v["entries"][3]["layers"][1]["compute_us"] = (-1.0).into());
    let msg = rejected(&text);
    assert!(
        msg.contains("tables/x.json: entries[3].layers[1].compute_us is negative (-1.0)"),
        "{msg}"
    );
}

#[test]
fn wrong_or_missing_schema() {
    let msg = rejected(&edit(|v| v["schema"] = "kvtier-slack/9".into()));
    assert!(
        msg.contains("schema is \"kvtier-slack/9\", not \"kvtier-slack/1\""),
        "{msg}"
    );
    let msg = rejected(&edit(|v| {
        v.as_object_mut().unwrap().remove("schema");
    }));
    assert!(msg.contains("schema is missing"), "{msg}");
    let msg = rejected("[1, 2]");
    assert!(msg.contains("the top level is an array"), "{msg}");
    let msg = rejected("{\"schema\": ");
    assert!(msg.contains("not valid JSON at line 1"), "{msg}");
}

#[test]
fn layer_count_must_match_model() {
    let msg = rejected(&edit(|v| {
        v["entries"][2]["layers"].as_array_mut().unwrap().pop();
    }));
    assert!(
        msg.contains("entries[2].layers has 1 rows but model.layers is 2"),
        "{msg}"
    );
}

#[test]
fn grid_must_increase() {
    let msg = rejected(&edit(|v| {
        v["prefix_lengths"] = serde_json::json!([0, 2048, 2048])
    }));
    assert!(
        msg.contains("prefix_lengths is not strictly increasing: prefix_lengths[2] is 2048 after prefix_lengths[1] = 2048"),
        "{msg}"
    );
    let msg = rejected(&edit(|v| {
        v["input_lengths"] = serde_json::json!([4096, 1024])
    }));
    assert!(
        msg.contains("input_lengths is not strictly increasing"),
        "{msg}"
    );
    let msg = rejected(&edit(|v| v["input_lengths"] = serde_json::json!([])));
    assert!(msg.contains("input_lengths is empty"), "{msg}");
    let msg = rejected(&edit(|v| v["decode"][1]["context"] = 10.into()));
    assert!(msg.contains("decode[1].context is 10"), "{msg}");
}

#[test]
fn missing_duplicate_and_stray_entries() {
    let msg = rejected(&edit(|v| {
        v["entries"].as_array_mut().unwrap().remove(4);
    }));
    assert!(
        msg.contains("entries has no entry for grid point (input 4096, prefix 2048)"),
        "{msg}"
    );
    let msg = rejected(&edit(|v| {
        let e = v["entries"][0].clone();
        v["entries"][4] = e;
    }));
    assert!(
        msg.contains("entries[4] repeats grid point (input 1024, prefix 0) of entries[0]"),
        "{msg}"
    );
    let msg = rejected(&edit(|v| v["entries"][1]["input"] = 1000.into()));
    assert!(
        msg.contains("entries[1].input is 1000, which is not in input_lengths"),
        "{msg}"
    );
}

#[test]
fn fields_named_when_missing_mistyped_or_unknown() {
    let msg = rejected(&edit(|v| {
        v["entries"][5]["layers"][0]
            .as_object_mut()
            .unwrap()
            .remove("slack_us");
    }));
    assert!(
        msg.contains("entries[5].layers[0].slack_us is missing"),
        "{msg}"
    );
    let msg = rejected(&edit(|v| {
        v["entries"][0]["layers"][1]["read_us"] = "fast".into()
    }));
    assert!(
        msg.contains("entries[0].layers[1].read_us is \"fast\" (a string); it must be a number"),
        "{msg}"
    );
    let msg = rejected(&edit(|v| {
        v["entries"][0]["layers"][1]["compute_ms"] = 1.into()
    }));
    assert!(
        msg.contains("entries[0].layers[1].compute_ms is not a field"),
        "{msg}"
    );
    let msg = rejected(&edit(|v| v["gpu"]["sms"] = (-4).into()));
    assert!(msg.contains("gpu.sms is negative (-4)"), "{msg}");
    let msg = rejected(&edit(|v| v["mode"] = "guess".into()));
    assert!(msg.contains("mode is \"guess\""), "{msg}");
    let msg = rejected(&edit(|v| v["storage"]["read_gbs"] = 0.into()));
    assert!(
        msg.contains("storage.read_gbs is 0.0; it must be a positive"),
        "{msg}"
    );
    let msg = rejected(&edit(|v| v["provenance"]["date"] = "31/01/2025".into()));
    assert!(msg.contains("provenance.date is \"31/01/2025\""), "{msg}");
    let msg = rejected(&edit(|v| v["estimated"] = false.into()));
    assert!(
        msg.contains("estimated is false but mode is \"analytic\""),
        "{msg}"
    );
    let msg = rejected(&edit(|v| v["model"]["dtype"] = "int3".into()));
    assert!(msg.contains("model.dtype is \"int3\""), "{msg}");
    let msg = rejected(&edit(|v| v["model"]["block_size"] = 1.into()));
    assert!(msg.contains("model: object size 2048 B"), "{msg}");
    let msg = rejected(&edit(|v| v["storage"]["source"] = "guessed".into()));
    assert!(msg.contains("storage.source is \"guessed\""), "{msg}");
}

#[test]
fn derived_columns_are_checked() {
    let msg = rejected(&edit(|v| {
        v["entries"][1]["layers"][0]["slack_us"] = 5.0.into()
    }));
    assert!(
        msg.contains("entries[1].layers[0].slack_us is 5.0 but compute_us - read_us"),
        "{msg}"
    );
    assert!(
        msg.contains("regenerate the table with kvtier-profile"),
        "{msg}"
    );
    let msg = rejected(&edit(|v| {
        v["entries"][1]["layers"][0]["write_iocbs"] = 7.into()
    }));
    assert!(
        msg.contains("entries[1].layers[0].write_iocbs is 7 but 0"),
        "{msg}"
    );
    let msg = rejected(&edit(|v| {
        v["entries"][1]["layers"][0]["read_iocbs"] = 3.into()
    }));
    assert!(
        msg.contains("entries[1].layers[0].read_iocbs is 3 but"),
        "{msg}"
    );
    let msg = rejected(&edit(|v| {
        v["entries"][1]["layers"][0]["sm_budget"] = 1.into()
    }));
    assert!(
        msg.contains("entries[1].layers[0].sm_budget is 1 but the rule gives 8"),
        "{msg}"
    );
    let msg = rejected(&edit(|v| {
        v["entries"][1]["layers"][0]["read_us"] = 1.0.into()
    }));
    assert!(
        msg.contains("entries[1].layers[0].read_us is 1.0 but reading 2048 prefix tokens"),
        "{msg}"
    );
    let msg = rejected(&edit(|v| v["decode"][0]["write_iocbs"] = 2.into()));
    assert!(
        msg.contains("decode[0].write_iocbs is 2 but 0 full IOCBs"),
        "{msg}"
    );
    let msg = rejected(&edit(|v| v["decode"][0]["step_us"] = (-3.0).into()));
    assert!(
        msg.contains("decode[0].step_us is negative (-3.0)"),
        "{msg}"
    );
}

#[test]
fn locate_cells() {
    let g = [0, 10, 30];
    assert_eq!(locate(&g, 0), (0, 0, 0.0));
    assert_eq!(locate(&g, 5), (0, 1, 0.5));
    assert_eq!(locate(&g, 10), (1, 1, 0.0));
    assert_eq!(locate(&g, 20), (1, 2, 0.5));
    assert_eq!(locate(&g, 99), (2, 2, 0.0));
    assert_eq!(locate(&[7], 3), (0, 0, 0.0));
    assert_eq!(locate(&[7], 9), (0, 0, 0.0));
    assert!(is_date("2025-01-31") && !is_date("2025-13-01") && !is_date("2025-1-31"));
}

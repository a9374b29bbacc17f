//! The loaded table: validation of every row against the rules, and lookup (interpolated
//! between grid points) of a layer's and a decode step's slack.

use super::*;

// ---------------------------------------------------------------------------
// Lookup results.

/// What a layer of a prefill allows: the answer of [`SlackTable::layer`].
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerSlack {
    /// The layer's compute window, µs.
    pub compute_us: f64,
    /// Time to read the layer's prefix KV, µs.
    pub read_us: f64,
    /// `compute_us − read_us`; negative when the read does not fit.
    pub slack_us: f64,
    /// SMs the I/O kernel may use.
    pub sm_budget: u32,
    /// IOCBs the layer's reads need.
    pub read_iocbs: u32,
    /// IOCBs of the layer's new KV writes that fit in the slack.
    pub write_iocbs: u32,
    /// Bytes of writes that fit in `max(0, slack_us)` at the table's write
    /// bandwidth (for a scheduler whose write jobs are not whole IOCBs).
    pub write_budget_bytes: u64,
}

impl LayerSlack {
    /// Time the compute would wait for the read if nothing else were done: `max(0, −slack)`.
    pub fn bubble_us(&self) -> f64 {
        (-self.slack_us).max(0.0)
    }

    /// Time left for writes after the read: `max(0, slack)`.
    pub fn write_window_us(&self) -> f64 {
        self.slack_us.max(0.0)
    }
}

/// What a decode step allows: the answer of [`SlackTable::decode`].
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeSlack {
    /// The (clamped) context the answer is for.
    pub context: u64,
    /// Time of one decode step, microseconds.
    pub step_us: f64,
    /// Time in a step the I/O may use, microseconds.
    pub slack_us: f64,
    /// SMs the I/O may take.
    pub sm_budget: u32,
    /// Full write IOCBs of deferred writes that fit in the step.
    pub write_iocbs: u32,
    /// Bytes of writes that fit in `max(0, slack_us)` at the table's write
    /// bandwidth: for a scheduler whose write jobs are not whole IOCBs, and
    /// (decode slack being short next to a full IOCB) for carrying unused
    /// slack across steps.
    pub write_budget_bytes: u64,
}

// ---------------------------------------------------------------------------
// The loaded table.

/// A validated slack table. Build one with [`SlackTable::load`],
/// [`SlackTable::from_json_str`] or [`SlackTable::build`].
#[derive(Clone, Debug)]
pub struct SlackTable {
    file: TableFile,
    source: String,
    geometry: KvGeometry,
    /// `cells[i * prefixes + p]` = index in `file.entries` of grid point (i, p).
    cells: Vec<usize>,
}

impl SlackTable {
    /// Reads and validates a table file; errors name the file, the field and the fix.
    pub fn load(path: impl AsRef<Path>) -> Result<SlackTable> {
        let path = path.as_ref();
        let source = path.display().to_string();
        let text = crate::json::read_user_file(path, MAX_TABLE_BYTES).map_err(|why| {
            Error::invalid(format!(
                "{source}: cannot read the slack table: {why}; pass a table made by kvtier-profile, e.g. tables/llama3-8b.h100.json"
            ))
        })?;
        Self::from_json_str(&text, &source)
    }

    /// Parses and validates a table; `source_name` (a path) starts every error message.
    pub fn from_json_str(text: &str, source_name: &str) -> Result<SlackTable> {
        let err = |what: String| Error::invalid(format!("{source_name}: {what}"));
        let top = crate::json::parse_object(
            text,
            "a slack table is the JSON kvtier-profile writes",
            "a slack table is the JSON object kvtier-profile writes",
        )
        .map_err(err)?;
        // The schema first: a file of another kind or version should say so,
        // not list every field it lacks.
        match top.get("schema") {
            None => {
                return Err(err(format!(
                    "schema is missing; a slack table starts with \"schema\": \"{SCHEMA}\" (make tables with kvtier-profile)"
                )))
            }
            Some(Value::String(s)) if s == SCHEMA => {}
            Some(other) => {
                return Err(err(format!(
                    "schema is {}, not \"{SCHEMA}\"; this kvtier reads {SCHEMA} tables only: regenerate the table with this version's kvtier-profile",
                    crate::json::value_excerpt(other)
                )))
            }
        }
        let value = Value::Object(top);
        check_shape(&value, TABLE_TY, "", source_name)?;
        let file: TableFile = serde_json::from_value(value).map_err(|e| {
            err(format!(
                "does not match the slack table schema ({}); regenerate it with kvtier-profile",
                crate::json::excerpt(&e.to_string(), 200)
            ))
        })?;
        Self::validate(file, source_name)
    }

    /// Derives every row from compute times by this module's rules, then
    /// validates the result like a loaded table.
    ///
    /// `compute_us[i * prefix_lengths.len() + p]` holds the per-layer compute
    /// times of grid point (`input_lengths[i]`, `prefix_lengths[p]`);
    /// `decode_step_us` holds (context, step µs) pairs. `source_name` names the
    /// table in errors (the path it will be written to).
    pub fn build(
        header: TableHeader,
        input_lengths: Vec<u64>,
        prefix_lengths: Vec<u64>,
        compute_us: &[Vec<f64>],
        decode_step_us: &[(u64, f64)],
        source_name: &str,
    ) -> Result<SlackTable> {
        let geometry = model_geometry(&header.model, source_name)?;
        check_storage(&header.storage, source_name)?;
        let points = input_lengths.len() * prefix_lengths.len();
        if compute_us.len() != points {
            return Err(Error::invalid(format!(
                "{source_name}: {} grid points of compute times for a {} x {} grid",
                compute_us.len(),
                input_lengths.len(),
                prefix_lengths.len()
            )));
        }
        let mut entries = Vec::with_capacity(points);
        for (i, &input) in input_lengths.iter().enumerate() {
            for (p, &prefix) in prefix_lengths.iter().enumerate() {
                let layers = compute_us[i * prefix_lengths.len() + p]
                    .iter()
                    .map(|&c| {
                        derive_layer(&geometry, &header.gpu, &header.storage, input, prefix, c)
                    })
                    .collect();
                entries.push(Entry {
                    input,
                    prefix,
                    layers,
                });
            }
        }
        let decode = decode_step_us
            .iter()
            .map(|&(context, step)| {
                derive_decode(&geometry, &header.gpu, &header.storage, context, step)
            })
            .collect();
        let file = TableFile {
            schema: SCHEMA.to_string(),
            model: header.model,
            gpu: header.gpu,
            storage: header.storage,
            mode: header.mode,
            estimated: header.estimated,
            provenance: header.provenance,
            input_lengths,
            prefix_lengths,
            entries,
            decode,
        };
        Self::validate(file, source_name)
    }

    /// Checks everything serde cannot: ranges, the grid, the rows' count and
    /// consistency with the rules.
    fn validate(file: TableFile, src: &str) -> Result<SlackTable> {
        let err = |what: String| Error::invalid(format!("{src}: {what}"));
        let geometry = model_geometry(&file.model, src)?;
        for (name, v) in [
            ("model.hidden_size", file.model.hidden_size),
            ("model.intermediate_size", file.model.intermediate_size),
            ("model.attention_heads", file.model.attention_heads),
            ("gpu.sms", file.gpu.sms),
        ] {
            if v == 0 {
                return Err(err(format!("{name} is 0; it must be a positive integer")));
            }
        }
        for (name, v) in [
            ("gpu.bf16_tflops", file.gpu.bf16_tflops),
            ("gpu.hbm_gbs", file.gpu.hbm_gbs),
        ] {
            if v <= 0.0 {
                return Err(err(format!("{name} is {v:?}; it must be positive")));
            }
        }
        check_storage(&file.storage, src)?;
        if file.mode == Mode::Analytic && !file.estimated {
            return Err(err(
                "estimated is false but mode is \"analytic\"; analytic compute times are estimates: set \"estimated\": true".into(),
            ));
        }
        if !is_date(&file.provenance.date) {
            return Err(err(format!(
                "provenance.date is {:?}; write it as YYYY-MM-DD",
                crate::json::excerpt(&file.provenance.date, 40)
            )));
        }
        if file.provenance.command.trim().is_empty() {
            return Err(err(
                "provenance.command is empty; record the kvtier-profile command line that made the table".into(),
            ));
        }
        check_grid(&file.input_lengths, "input_lengths", 1, src)?;
        check_grid(&file.prefix_lengths, "prefix_lengths", 0, src)?;

        // Entries: each on the grid, once, all of them. The grid's size
        // comes from two short lists and can be huge (60000 x 60000) while
        // the entries are few, so nothing is allocated per grid point before
        // the entries are known to cover it: a sparse map of the points seen,
        // and a dense table only when there are as many entries as points.
        let np = file.prefix_lengths.len();
        let ni = file.input_lengths.len();
        let points = ni.checked_mul(np);
        let mut seen: std::collections::HashMap<usize, usize> =
            std::collections::HashMap::with_capacity(file.entries.len());
        for (k, e) in file.entries.iter().enumerate() {
            let i = file.input_lengths.binary_search(&e.input).map_err(|_| {
                err(format!(
                    "entries[{k}].input is {}, which is not in input_lengths {}; every entry must be a grid point",
                    e.input,
                    crate::json::list_excerpt(&file.input_lengths)
                ))
            })?;
            let p = file.prefix_lengths.binary_search(&e.prefix).map_err(|_| {
                err(format!(
                    "entries[{k}].prefix is {}, which is not in prefix_lengths {}; every entry must be a grid point",
                    e.prefix,
                    crate::json::list_excerpt(&file.prefix_lengths)
                ))
            })?;
            if let Some(first) = seen.insert(i * np + p, k) {
                return Err(err(format!(
                    "entries[{k}] repeats grid point (input {}, prefix {}) of entries[{first}]; keep one entry per grid point",
                    e.input, e.prefix
                )));
            }
            if e.layers.len() != geometry.layers as usize {
                return Err(err(format!(
                    "entries[{k}].layers has {} rows but model.layers is {}; a table has one row per layer (was it made for another model?)",
                    e.layers.len(),
                    geometry.layers
                )));
            }
            for (l, row) in e.layers.iter().enumerate() {
                let path = format!("entries[{k}].layers[{l}]");
                check_layer(&geometry, &file, e.input, e.prefix, row, &path, src)?;
            }
        }
        if points != Some(seen.len()) {
            // Every entry is a distinct grid point, so there are fewer
            // entries than points and one of the first `entries + 1` points
            // (in row-major order) is missing: the search is bounded.
            let missing = (0..)
                .find(|c| !seen.contains_key(c))
                .expect("fewer entries than grid points");
            return Err(err(format!(
                "entries has no entry for grid point (input {}, prefix {}); a table needs one entry per pair of input_lengths x prefix_lengths ({} x {} = {}, found {})",
                file.input_lengths[missing / np],
                file.prefix_lengths[missing % np],
                ni,
                np,
                points.map_or_else(|| "too many".to_string(), |n| n.to_string()),
                file.entries.len()
            )));
        }
        let mut cells = vec![usize::MAX; seen.len()];
        for (cell, k) in seen {
            cells[cell] = k;
        }

        // Decode profile.
        if file.decode.is_empty() {
            return Err(err(
                "decode is empty; a table needs at least one decode row (context, step_us, ...)"
                    .into(),
            ));
        }
        for (k, row) in file.decode.iter().enumerate() {
            if k > 0 && row.context <= file.decode[k - 1].context {
                return Err(err(format!(
                    "decode[{k}].context is {}, not greater than decode[{}].context ({}); decode rows must be in strictly increasing context order",
                    row.context,
                    k - 1,
                    file.decode[k - 1].context
                )));
            }
            check_decode(&geometry, &file, row, &format!("decode[{k}]"), src)?;
        }
        Ok(SlackTable {
            file,
            source: src.to_string(),
            geometry,
            cells,
        })
    }

    /// The table as JSON: pretty at the top, one line per layer row and decode row.
    pub fn to_json_string(&self) -> String {
        fn j<T: Serialize + ?Sized>(v: &T) -> String {
            serde_json::to_string(v).expect("slack table values serialize")
        }
        let f = &self.file;
        let mut s = String::new();
        s.push_str(&format!("{{\n  \"schema\": {},\n", j(&f.schema)));
        s.push_str(&format!("  \"model\": {},\n", j(&f.model)));
        s.push_str(&format!("  \"gpu\": {},\n", j(&f.gpu)));
        s.push_str(&format!("  \"storage\": {},\n", j(&f.storage)));
        s.push_str(&format!("  \"mode\": {},\n", j(&f.mode)));
        s.push_str(&format!("  \"estimated\": {},\n", j(&f.estimated)));
        let prov = serde_json::to_string_pretty(&f.provenance)
            .expect("provenance serializes")
            .replace('\n', "\n  ");
        s.push_str(&format!("  \"provenance\": {prov},\n"));
        s.push_str(&format!("  \"input_lengths\": {},\n", j(&f.input_lengths)));
        s.push_str(&format!(
            "  \"prefix_lengths\": {},\n",
            j(&f.prefix_lengths)
        ));
        s.push_str("  \"entries\": [\n");
        for (k, e) in f.entries.iter().enumerate() {
            s.push_str(&format!(
                "    {{\"input\": {}, \"prefix\": {}, \"layers\": [\n",
                e.input, e.prefix
            ));
            for (l, row) in e.layers.iter().enumerate() {
                let sep = if l + 1 < e.layers.len() { "," } else { "" };
                s.push_str(&format!("      {}{sep}\n", j(row)));
            }
            let sep = if k + 1 < f.entries.len() { "," } else { "" };
            s.push_str(&format!("    ]}}{sep}\n"));
        }
        s.push_str("  ],\n  \"decode\": [\n");
        for (k, row) in f.decode.iter().enumerate() {
            let sep = if k + 1 < f.decode.len() { "," } else { "" };
            s.push_str(&format!("    {}{sep}\n", j(row)));
        }
        s.push_str("  ]\n}\n");
        s
    }

    /// The file or name the table was loaded from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Everything in the file.
    pub fn file(&self) -> &TableFile {
        &self.file
    }

    /// The KV geometry the table was made for.
    pub fn geometry(&self) -> KvGeometry {
        self.geometry
    }

    /// The model.
    pub fn model(&self) -> &ModelInfo {
        &self.file.model
    }

    /// The GPU.
    pub fn gpu(&self) -> &GpuInfo {
        &self.file.gpu
    }

    /// The storage.
    pub fn storage(&self) -> &StorageInfo {
        &self.file.storage
    }

    /// Where the compute times came from.
    pub fn mode(&self) -> Mode {
        self.file.mode
    }

    /// Whether the times are estimates.
    pub fn estimated(&self) -> bool {
        self.file.estimated
    }

    /// Who made it, where, when, how.
    pub fn provenance(&self) -> &Provenance {
        &self.file.provenance
    }

    /// Layers of the model.
    pub fn layers(&self) -> u32 {
        self.geometry.layers
    }

    /// The grid's input lengths.
    pub fn input_lengths(&self) -> &[u64] {
        &self.file.input_lengths
    }

    /// The grid's prefix lengths.
    pub fn prefix_lengths(&self) -> &[u64] {
        &self.file.prefix_lengths
    }

    /// The entry of grid point (`input_lengths[i]`, `prefix_lengths[p]`).
    pub fn entry(&self, i: usize, p: usize) -> &Entry {
        &self.file.entries[self.cells[i * self.file.prefix_lengths.len() + p]]
    }

    /// Whether (input, prefix) lies inside the grid (lookups outside are clamped).
    pub fn covers(&self, input: u64, prefix: u64) -> bool {
        let within = |g: &[u64], x: u64| g[0] <= x && x <= g[g.len() - 1];
        within(&self.file.input_lengths, input) && within(&self.file.prefix_lengths, prefix)
    }

    /// Layer `layer` of a prefill of `input` new tokens over `prefix` cached
    /// ones (clamped and interpolated as the module docs say). Errors when the
    /// layer is not one of the model's.
    pub fn layer(&self, input: u64, prefix: u64, layer: u32) -> Result<LayerSlack> {
        if layer >= self.geometry.layers {
            return Err(Error::invalid(format!(
                "slack table {}: layer {layer} asked, but the model has {} layers (0..{})",
                self.source, self.geometry.layers, self.geometry.layers
            )));
        }
        Ok(self.layer_at(input, prefix, layer as usize))
    }

    /// Every layer of a prefill, in order (see [`layer`](Self::layer)).
    pub fn prefill(&self, input: u64, prefix: u64) -> Vec<LayerSlack> {
        (0..self.geometry.layers as usize)
            .map(|l| self.layer_at(input, prefix, l))
            .collect()
    }

    /// Total compute time of a prefill (all layers), µs.
    pub fn prefill_compute_us(&self, input: u64, prefix: u64) -> f64 {
        self.prefill(input, prefix)
            .iter()
            .map(|l| l.compute_us)
            .sum()
    }

    fn layer_at(&self, input: u64, prefix: u64, layer: usize) -> LayerSlack {
        let f = &self.file;
        let (i0, i1, t) = locate(&f.input_lengths, input);
        let (p0, p1, u) = locate(&f.prefix_lengths, prefix);
        let row = |i: usize, p: usize| &self.entry(i, p).layers[layer];
        let (r00, r01, r10, r11) = (row(i0, p0), row(i0, p1), row(i1, p0), row(i1, p1));
        let mix = |get: fn(&LayerRow) -> f64| {
            get(r00) * (1.0 - t) * (1.0 - u)
                + get(r10) * t * (1.0 - u)
                + get(r01) * (1.0 - t) * u
                + get(r11) * t * u
        };
        let input = clamp_to(&f.input_lengths, input);
        let prefix = clamp_to(&f.prefix_lengths, prefix);
        let row = complete_layer(
            &self.geometry,
            &f.gpu,
            &f.storage,
            input,
            prefix,
            mix(|r| r.compute_us),
            mix(|r| r.read_us),
            mix(|r| r.slack_us),
        );
        LayerSlack {
            compute_us: row.compute_us,
            read_us: row.read_us,
            slack_us: row.slack_us,
            sm_budget: row.sm_budget,
            read_iocbs: row.read_iocbs,
            write_iocbs: row.write_iocbs,
            write_budget_bytes: write_budget_bytes(row.slack_us, f.storage.write_gbs),
        }
    }

    /// A decode step at `context` tokens: clamped to the profiled contexts,
    /// linear between them; `write_iocbs` floored from the interpolated slack.
    pub fn decode(&self, context: u64) -> DecodeSlack {
        let f = &self.file;
        let contexts: Vec<u64> = f.decode.iter().map(|d| d.context).collect();
        let (k0, k1, t) = locate(&contexts, context);
        let (a, b) = (&f.decode[k0], &f.decode[k1]);
        let step = a.step_us * (1.0 - t) + b.step_us * t;
        let slack = a.slack_us * (1.0 - t) + b.slack_us * t;
        let context = clamp_to(&contexts, context);
        let row = complete_decode(&self.geometry, &f.gpu, &f.storage, context, step, slack);
        DecodeSlack {
            context,
            step_us: row.step_us,
            slack_us: row.slack_us,
            sm_budget: row.sm_budget,
            write_iocbs: row.write_iocbs,
            write_budget_bytes: write_budget_bytes(row.slack_us, f.storage.write_gbs),
        }
    }

    /// Time to write one full IOCB ([`IOCB_OBJECTS`] objects) on this table's storage, µs.
    pub fn full_iocb_write_us(&self) -> f64 {
        full_iocb_write_us(&self.geometry, self.file.storage.write_gbs)
    }

    /// Errors unless `geometry` is the one the table was made for (its read
    /// times and IOCB counts depend on the object size).
    pub fn check_geometry(&self, geometry: &KvGeometry) -> Result<()> {
        let t = &self.geometry;
        let mut diffs = Vec::new();
        let mut diff = |name: &str, table: String, given: String| {
            if table != given {
                diffs.push(format!("{name} {table} (table) vs {given}"));
            }
        };
        diff("layers", t.layers.to_string(), geometry.layers.to_string());
        diff(
            "kv_heads",
            t.kv_heads.to_string(),
            geometry.kv_heads.to_string(),
        );
        diff(
            "head_dim",
            t.head_dim.to_string(),
            geometry.head_dim.to_string(),
        );
        diff("dtype", t.dtype.to_string(), geometry.dtype.to_string());
        diff(
            "block_size",
            t.block_size.to_string(),
            geometry.block_size.to_string(),
        );
        if diffs.is_empty() {
            return Ok(());
        }
        Err(Error::invalid(format!(
            "slack table {} is for {} ({}), not for this geometry: {}",
            self.source,
            self.file.model.name,
            t.describe(),
            diffs.join(", "),
        ))
        .with_fix(crate::error::Fix::ProfileSlackTable {
            block_size: geometry.block_size,
        }))
    }
}

// ---------------------------------------------------------------------------
// Validation helpers.

pub(super) fn model_geometry(m: &ModelInfo, src: &str) -> Result<KvGeometry> {
    let dtype = DType::parse(&m.dtype).ok_or_else(|| {
        Error::invalid(format!(
            "{src}: model.dtype is {:?}, not a known KV dtype; use one of {}",
            crate::json::excerpt(&m.dtype, 40),
            DType::ALL.map(DType::name).join(", ")
        ))
    })?;
    let geometry = KvGeometry {
        layers: m.layers,
        kv_heads: m.kv_heads,
        head_dim: m.head_dim,
        dtype,
        block_size: m.block_size,
    };
    geometry.validate().map_err(|e| {
        let reason = match e {
            Error::ModelConfig { reason, .. } => reason,
            other => other.to_string(),
        };
        // The geometry's field names are those of `model`.
        Error::invalid(format!("{src}: model: {reason}"))
    })?;
    Ok(geometry)
}

pub(super) fn check_storage(s: &StorageInfo, src: &str) -> Result<()> {
    for (name, v) in [
        ("storage.read_gbs", s.read_gbs),
        ("storage.write_gbs", s.write_gbs),
    ] {
        if !(v > 0.0 && v.is_finite()) {
            return Err(Error::invalid(format!(
                "{src}: {name} is {v:?}; it must be a positive bandwidth in GB/s"
            )));
        }
    }
    if !(s.iocb_service_us >= 0.0 && s.iocb_service_us.is_finite()) {
        return Err(Error::invalid(format!(
            "{src}: storage.iocb_service_us is {:?}; it must be ≥ 0 µs",
            s.iocb_service_us
        )));
    }
    if !(s.source.starts_with("measured on ") || s.source.starts_with("assumed")) {
        return Err(Error::invalid(format!(
            "{src}: storage.source is {:?}; it must say how the numbers were obtained: \"measured on <pool dir> ...\" or \"assumed: ...\"",
            crate::json::excerpt(&s.source, 60)
        )));
    }
    Ok(())
}

pub(super) fn check_grid(grid: &[u64], name: &str, min: u64, src: &str) -> Result<()> {
    if grid.is_empty() {
        return Err(Error::invalid(format!(
            "{src}: {name} is empty; a grid needs at least one value"
        )));
    }
    if grid[0] < min {
        return Err(Error::invalid(format!(
            "{src}: {name}[0] is {}; values must be at least {min}",
            grid[0]
        )));
    }
    for k in 1..grid.len() {
        if grid[k] <= grid[k - 1] {
            return Err(Error::invalid(format!(
                "{src}: {name} is not strictly increasing: {name}[{k}] is {} after {name}[{}] = {}; list each value once, ascending",
                grid[k],
                k - 1,
                grid[k - 1]
            )));
        }
    }
    Ok(())
}

/// The longest time a table may hold, µs (a day): past it a value is a
/// mistake, and it would overflow the durations a replay sleeps for.
pub(super) const MAX_TIME_US: f64 = 86_400e6;

pub(super) fn check_time(v: f64, path: &str, src: &str) -> Result<()> {
    if v < 0.0 {
        return Err(Error::invalid(format!(
            "{src}: {path} is negative ({v:?}); times are ≥ 0 µs"
        )));
    }
    if v.is_nan() || v > MAX_TIME_US {
        return Err(Error::invalid(format!(
            "{src}: {path} is {v:?}; times are at most {MAX_TIME_US:e} µs (a day)"
        )));
    }
    Ok(())
}

pub(super) fn near(a: f64, b: f64) -> bool {
    (a - b).abs() <= TIME_TOLERANCE_US
}

pub(super) const REGENERATE: &str =
    "derived columns follow from the times and the storage numbers: regenerate the table with kvtier-profile instead of editing it";

pub(super) fn check_layer(
    geometry: &KvGeometry,
    file: &TableFile,
    input: u64,
    prefix: u64,
    row: &LayerRow,
    path: &str,
    src: &str,
) -> Result<()> {
    let err = |what: String| Error::invalid(format!("{src}: {path}.{what}; {REGENERATE}"));
    check_time(row.compute_us, &format!("{path}.compute_us"), src)?;
    check_time(row.read_us, &format!("{path}.read_us"), src)?;
    let want_read = read_us(geometry, file.storage.read_gbs, prefix);
    if !near(row.read_us, want_read) {
        return Err(err(format!(
            "read_us is {:?} but reading {} prefix tokens ({} blocks x 2 objects of {} B) at storage.read_gbs {} takes {want_read:?}",
            row.read_us,
            prefix,
            geometry.tokens_to_blocks(prefix),
            geometry.object_bytes(),
            file.storage.read_gbs
        )));
    }
    if !near(row.slack_us, row.compute_us - row.read_us) {
        return Err(err(format!(
            "slack_us is {:?} but compute_us - read_us is {:?}",
            row.slack_us,
            row.compute_us - row.read_us
        )));
    }
    let want = complete_layer(
        geometry,
        &file.gpu,
        &file.storage,
        input,
        prefix,
        row.compute_us,
        row.read_us,
        row.slack_us,
    );
    if row.read_iocbs != want.read_iocbs {
        return Err(err(format!(
            "read_iocbs is {} but {} prefix tokens need {} (ceil(2 x {} blocks / {IOCB_OBJECTS}))",
            row.read_iocbs,
            prefix,
            want.read_iocbs,
            geometry.tokens_to_blocks(prefix)
        )));
    }
    if row.write_iocbs != want.write_iocbs {
        return Err(err(format!(
            "write_iocbs is {} but {} of the layer's new-KV IOCBs ({} input tokens) fit in slack_us {:?} at storage.write_gbs {}",
            row.write_iocbs, want.write_iocbs, input, row.slack_us, file.storage.write_gbs
        )));
    }
    if row.sm_budget != want.sm_budget {
        return Err(err(format!(
            "sm_budget is {} but the rule gives {} (between {SM_BUDGET_MIN} and {} of gpu.sms {}, by the I/O fraction of compute_us)",
            row.sm_budget,
            want.sm_budget,
            sm_budget_max(file.gpu.sms),
            file.gpu.sms
        )));
    }
    Ok(())
}

pub(super) fn check_decode(
    geometry: &KvGeometry,
    file: &TableFile,
    row: &DecodeRow,
    path: &str,
    src: &str,
) -> Result<()> {
    let err = |what: String| Error::invalid(format!("{src}: {path}.{what}; {REGENERATE}"));
    check_time(row.step_us, &format!("{path}.step_us"), src)?;
    let own = decode_own_write_us(geometry, file.storage.write_gbs);
    if !near(row.slack_us, row.step_us - own) {
        return Err(err(format!(
            "slack_us is {:?} but step_us minus the step's own KV write ({own:.3} µs) is {:?}",
            row.slack_us,
            row.step_us - own
        )));
    }
    let want = complete_decode(
        geometry,
        &file.gpu,
        &file.storage,
        row.context,
        row.step_us,
        row.slack_us,
    );
    if row.write_iocbs != want.write_iocbs {
        return Err(err(format!(
            "write_iocbs is {} but {} full IOCBs ({:.3} µs each at storage.write_gbs {}) fit in slack_us {:?}",
            row.write_iocbs,
            want.write_iocbs,
            full_iocb_write_us(geometry, file.storage.write_gbs),
            file.storage.write_gbs,
            row.slack_us
        )));
    }
    if row.sm_budget != want.sm_budget {
        return Err(err(format!(
            "sm_budget is {} but the rule gives {}",
            row.sm_budget, want.sm_budget
        )));
    }
    Ok(())
}

pub(super) fn is_date(s: &str) -> bool {
    let b = s.as_bytes();
    if b.len() != 10 || b[4] != b'-' || b[7] != b'-' {
        return false;
    }
    let digits = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_digit);
    if !(digits(0..4) && digits(5..7) && digits(8..10)) {
        return false;
    }
    let month: u32 = s[5..7].parse().unwrap_or(0);
    let day: u32 = s[8..10].parse().unwrap_or(0);
    (1..=12).contains(&month) && (1..=31).contains(&day)
}

/// The grid cell holding `x`: (lower index, upper index, weight of the upper).
/// Outside the grid both indices are the nearest edge and the weight is 0.
pub(super) fn locate(grid: &[u64], x: u64) -> (usize, usize, f64) {
    let n = grid.len();
    if x <= grid[0] {
        return (0, 0, 0.0);
    }
    if x >= grid[n - 1] {
        return (n - 1, n - 1, 0.0);
    }
    let hi = grid.partition_point(|&g| g <= x);
    let lo = hi - 1;
    if grid[lo] == x {
        return (lo, lo, 0.0);
    }
    (lo, hi, (x - grid[lo]) as f64 / (grid[hi] - grid[lo]) as f64)
}

pub(super) fn clamp_to(grid: &[u64], x: u64) -> u64 {
    x.clamp(grid[0], grid[grid.len() - 1])
}

//! Human and JSON output. Human output is aligned text; `--json` prints one JSON document.

use std::fmt::Write as _;

/// Prints rows as an aligned table under `headers`.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(cell.chars().count());
            }
        }
    }
    let mut out = String::new();
    let line = |out: &mut String, cells: Vec<&str>| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            let w = widths.get(i).copied().unwrap_or(0);
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                let _ = write!(s, "{c:<w$}  ");
            }
        }
        out.push_str(s.trim_end());
        out.push('\n');
    };
    line(&mut out, headers.to_vec());
    for row in rows {
        line(&mut out, row.iter().map(String::as_str).collect());
    }
    out
}

/// A duration in ms as `1.2s`, `3m04s`, `2h05m`.
pub fn age(ms: i64) -> String {
    let s = ms.max(0) / 1000;
    if ms < 10_000 {
        format!("{:.1}s", ms.max(0) as f64 / 1000.0)
    } else if s < 3600 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    }
}

/// Prints a JSON value, pretty.
pub fn print_json(v: &serde_json::Value) {
    match serde_json::to_string_pretty(v) {
        Ok(s) => println!("{s}"),
        Err(e) => eprintln!("orch: cannot render JSON: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_aligns_columns() {
        let t = table(&["a", "bbb"], &[vec!["xxxx".into(), "y".into()]]);
        assert_eq!(t, "a     bbb\nxxxx  y\n");
    }

    #[test]
    fn ages() {
        assert_eq!(age(1234), "1.2s");
        assert_eq!(age(64_000), "1m04s");
        assert_eq!(age(7_500_000), "2h05m");
        assert_eq!(age(-5), "0.0s");
    }
}

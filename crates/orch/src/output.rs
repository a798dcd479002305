//! Human and JSON output. Human output is aligned text fitted to the terminal's width (never
//! cut when stdout is not a terminal, unless `COLUMNS` says how wide); `--json` prints one JSON
//! document. Colour only goes to a terminal, and never when `NO_COLOR` is set.

use std::fmt::Write as _;
use std::io::IsTerminal;

/// Whether to colour what goes to `stream`: a terminal, and `NO_COLOR` unset or empty.
pub fn colour(stream: &impl IsTerminal) -> bool {
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    !no_color && stream.is_terminal()
}

/// The width human output is fitted to: `COLUMNS` when set, else the terminal's width when
/// stdout is a terminal; `None` (do not cut) when output goes to a file or a pipe.
pub fn width() -> Option<usize> {
    if let Some(cols) = std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.trim().parse::<usize>().ok())
        .filter(|c| *c > 0)
    {
        return Some(cols);
    }
    if !std::io::stdout().is_terminal() {
        return None;
    }
    // SAFETY: TIOCGWINSZ fills a `winsize` we own; a failure leaves it zeroed.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &mut ws) };
    (rc == 0 && ws.ws_col > 0).then_some(usize::from(ws.ws_col))
}

/// `s` cut to `max` characters, ending in `…` when cut.
pub fn cut(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_owned();
    }
    let mut out: String = s.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}

/// [`table`] whose last column is cut so each line fits in `width` (at least 12 characters of
/// it are kept); `None` cuts nothing.
pub fn table_fit(headers: &[&str], rows: &[Vec<String>], width: Option<usize>) -> String {
    let Some(width) = width else {
        return table(headers, rows);
    };
    let last = headers.len().saturating_sub(1);
    let mut used = 0;
    for (i, header) in headers.iter().enumerate().take(last) {
        let w = rows
            .iter()
            .filter_map(|r| r.get(i))
            .map(|c| c.chars().count())
            .chain(std::iter::once(header.chars().count()))
            .max()
            .unwrap_or(0);
        used += w + 2;
    }
    let room = width.saturating_sub(used).max(12);
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let mut r = r.clone();
            if let Some(c) = r.get_mut(last) {
                *c = cut(c, room);
            }
            r
        })
        .collect();
    table(headers, &rows)
}

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
        Err(e) => crate::say(&format!("orch: cannot render JSON: {e}")),
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
    fn the_last_column_is_cut_to_the_width_given_not_a_fixed_124() {
        let long = "x".repeat(300);
        let rows = vec![vec!["+1.0s".to_owned(), long.clone()]];
        let wide = table_fit(&["at", "what"], &rows, Some(250));
        assert!(wide.lines().all(|l| l.chars().count() <= 250), "{wide}");
        assert!(wide.lines().nth(1).unwrap().chars().count() == 250);
        let narrow = table_fit(&["at", "what"], &rows, Some(40));
        assert!(narrow.lines().all(|l| l.chars().count() <= 40), "{narrow}");
        assert!(narrow.contains('…'));
        let uncut = table_fit(&["at", "what"], &rows, None);
        assert!(uncut.contains(&long));
    }

    #[test]
    fn ages() {
        assert_eq!(age(1234), "1.2s");
        assert_eq!(age(64_000), "1m04s");
        assert_eq!(age(7_500_000), "2h05m");
        assert_eq!(age(-5), "0.0s");
    }
}

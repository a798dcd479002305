//! Human and JSON output, and the one place the binary prints: [`out`], [`outln`] (stdout),
//! [`say`] (stderr) and [`print_json`]. Human output is aligned text fitted to the terminal's
//! width (never cut when stdout is not a terminal, unless `COLUMNS` says how wide); `--json`
//! prints one JSON document. Colour only goes to a terminal, and never when `NO_COLOR` is set.
//!
//! What orch prints carries text that came from agents and users (titles, event texts,
//! reasons, artifact excerpts, file names, errors): everything printed goes through
//! [`terminal_safe`] on its way out, so no escape sequence, control character or
//! direction-changing mark reaches the terminal. JSON stays exact data: the encoder escapes
//! control characters, and [`json_text`] also writes DEL, the C1 controls and the invisible
//! and direction-changing marks as `\uXXXX` escapes, which decode to the same text.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::io::{IsTerminal, Write as _};
use std::sync::atomic::{AtomicBool, Ordering};

use orch_domain::text::{is_control, is_hidden_format};

/// What stands for each escape sequence or character [`terminal_safe`] takes out.
pub const REPLACEMENT: char = '\u{FFFD}';

/// `text` as it is safe to hand to a terminal: every escape sequence (ESC or its 8-bit C1
/// form followed by a CSI, OSC, DCS, SOS, PM or APC body, or a two-character escape) becomes
/// one [`REPLACEMENT`], as does every other control character (C0 but line feed and tab, DEL,
/// C1) and every invisible or direction-changing mark
/// ([`orch_domain::text::is_hidden_format`]); `\r\n` becomes `\n`. Text with none of them
/// is returned as it is.
pub fn terminal_safe(text: &str) -> Cow<'_, str> {
    let clean = |c: char| (!is_control(c) || c == '\n' || c == '\t') && !is_hidden_format(c);
    if text.chars().all(clean) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if clean(c) {
            out.push(c);
            continue;
        }
        if c == '\r' && chars.peek() == Some(&'\n') {
            continue;
        }
        out.push(REPLACEMENT);
        let body = match c {
            '\u{1b}' => match chars.peek().copied() {
                Some('[') => Some(Body::Csi),
                Some(']') => Some(Body::String { bel_ends: true }),
                Some('P' | 'X' | '^' | '_') => Some(Body::String { bel_ends: false }),
                Some(' '..='/') => Some(Body::Nf),
                Some('0'..='~') => Some(Body::One),
                _ => None,
            },
            '\u{9b}' => {
                skip_csi(&mut chars);
                None
            }
            '\u{9d}' => {
                skip_string(&mut chars, true);
                None
            }
            '\u{90}' | '\u{98}' | '\u{9e}' | '\u{9f}' => {
                skip_string(&mut chars, false);
                None
            }
            _ => None,
        };
        match body {
            Some(Body::Csi) => {
                chars.next();
                skip_csi(&mut chars);
            }
            Some(Body::String { bel_ends }) => {
                chars.next();
                skip_string(&mut chars, bel_ends);
            }
            Some(Body::Nf) => {
                while chars.next_if(|c| matches!(c, ' '..='/')).is_some() {}
                chars.next_if(|c| matches!(c, '0'..='~'));
            }
            Some(Body::One) => {
                chars.next();
            }
            None => {}
        }
    }
    Cow::Owned(out)
}

/// What follows an ESC.
enum Body {
    /// `[` parameters, intermediates, a final byte.
    Csi,
    /// A string ended by ST (`ESC \\`, `U+009C`), or by BEL too for OSC.
    String { bel_ends: bool },
    /// Intermediates (` `–`/`) and one final byte (`ESC ( B`).
    Nf,
    /// One final byte (`ESC c`, `ESC 7`).
    One,
}

/// Skips a CSI's parameter and intermediate bytes and its final byte (`@`–`~`); stops at
/// anything else, which is then read as text (or taken out as a control).
fn skip_csi(chars: &mut std::iter::Peekable<std::str::Chars<'_>>) {
    while chars
        .next_if(|c| matches!(c, '0'..='?' | ' '..='/'))
        .is_some()
    {}
    chars.next_if(|c| matches!(c, '@'..='~'));
}

/// Skips a control string up to and including its terminator (or to the end).
fn skip_string(chars: &mut std::iter::Peekable<std::str::Chars<'_>>, bel_ends: bool) {
    while let Some(c) = chars.next() {
        match c {
            '\u{7}' if bel_ends => return,
            '\u{9c}' => return,
            '\u{1b}' => {
                chars.next_if_eq(&'\\');
                return;
            }
            _ => {}
        }
    }
}

/// Whether a command ends when its stdout's reader has gone (see [`reader_gone`]): true for
/// the short commands; `serve`, `worker` and the demo turn it off, since they have work and
/// cleanup to finish whoever reads what they print.
static END_WHEN_UNREAD: AtomicBool = AtomicBool::new(true);

/// From now on a stdout whose reader has gone is ignored instead of ending the process: for
/// the long-running commands.
pub fn keep_running_when_unread() {
    END_WHEN_UNREAD.store(false, Ordering::Relaxed);
}

/// A write to stdout ended: when it failed because nobody reads it any more (`orch logs X |
/// head -1`, a pager quit), a short command stops there, quietly, the way a filter does: it
/// dies of SIGPIPE (status 141 in a shell), with no message and no work after it. Any other
/// failure (a full disk) is not an error of the command.
fn wrote(result: std::io::Result<()>) {
    if let Err(e) = result
        && e.kind() == std::io::ErrorKind::BrokenPipe
        && END_WHEN_UNREAD.load(Ordering::Relaxed)
    {
        reader_gone();
    }
}

/// Ends the process as SIGPIPE's default action would have: Rust's runtime ignores the
/// signal (so writes fail with `EPIPE` instead), so it is restored and raised.
fn reader_gone() -> ! {
    // SAFETY: restoring a signal's default action and raising it in this process.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        libc::raise(libc::SIGPIPE);
    }
    // Not reached: the signal ends the process. Should it not, the status a shell shows.
    std::process::exit(128 + libc::SIGPIPE)
}

/// Prints `text` on stdout, made [`terminal_safe`]. A stdout whose reader has gone ends a
/// short command ([`wrote`]); other write failures are ignored.
pub fn out(text: &str) {
    let mut stdout = std::io::stdout().lock();
    wrote(
        stdout
            .write_all(terminal_safe(text).as_bytes())
            .and_then(|()| stdout.flush()),
    );
}

/// [`out`] and a line feed.
pub fn outln(text: &str) {
    out(&format!("{text}\n"));
}

/// A line on stderr, made [`terminal_safe`], that cannot panic (`eprintln!` does when stderr
/// is a closed pipe).
pub fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "{}", terminal_safe(line));
}

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

/// Prints rows as an aligned table under `headers`. Cells are made [`terminal_safe`] first, so
/// the columns are measured on what will be shown.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|r| r.iter().map(|c| terminal_safe(c).into_owned()).collect())
        .collect();
    let rows = rows.as_slice();
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

/// Prints a JSON value, pretty ([`print_json_str`]).
pub fn print_json(v: &serde_json::Value) {
    match serde_json::to_string_pretty(v) {
        Ok(s) => print_json_str(&s),
        Err(e) => say(&format!("orch: cannot render JSON: {e}")),
    }
}

/// Prints JSON text serde_json wrote, as [`json_text`] makes it, and a line feed.
pub fn print_json_str(json: &str) {
    let mut stdout = std::io::stdout().lock();
    wrote(writeln!(stdout, "{}", json_text(json)).and_then(|()| stdout.flush()));
}

/// JSON text from serde_json with DEL, the C1 controls and the invisible and
/// direction-changing marks also written as `\uXXXX`: the same data (they can only be inside
/// strings, where the escape means the character), none of it acted on by a terminal.
pub fn json_text(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        match (is_control(c) && c != '\n') || is_hidden_format(c) {
            true => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            false => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(input: &str, expect: &str) {
        assert_eq!(terminal_safe(input), expect, "{input:?}");
        assert_eq!(terminal_safe(expect), expect, "{expect:?} is already safe");
    }

    #[test]
    fn nothing_a_terminal_acts_on_is_printed() {
        let r = REPLACEMENT;
        check(
            "plain text\twith a tab\nand lines",
            "plain text\twith a tab\nand lines",
        );
        check("a\u{1b}[2J\u{1b}[Hb", &format!("a{r}{r}b"));
        check("\u{1b}[38;5;196mred\u{1b}[0m", &format!("{r}red{r}"));
        check("\u{1b}]0;pwned\u{7}title", &format!("{r}title"));
        check(
            "\u{1b}]8;;http://x\u{1b}\\link\u{1b}]8;;\u{1b}\\",
            &format!("{r}link{r}"),
        );
        check("\u{1b}P+q\u{1b}\\x", &format!("{r}x"));
        check("\u{1b}(Bx\u{1b}cy\u{1b}", &format!("{r}x{r}y{r}"));
        check("\u{9b}31mc1\u{9d}2;t\u{9c}z", &format!("{r}c1{r}z"));
        check(
            "bell\u{7} del\u{7f} nul\u{0}",
            &format!("bell{r} del{r} nul{r}"),
        );
        check("crlf\r\nlone\rcr", &format!("crlf\nlone{r}cr"));
        check(
            "evil\u{202e}txt.exe \u{2066}x\u{2069}",
            &format!("evil{r}txt.exe {r}x{r}"),
        );
        check("emoji 👩\u{200d}💻 and é", "emoji 👩\u{200d}💻 and é");
        check("\u{1b}[", &r.to_string());
        check("\u{1b}]unterminated", &r.to_string());
    }

    #[test]
    fn json_keeps_the_data_and_hides_nothing_raw() {
        let v = serde_json::json!({"title": "a\u{1b}[2J\u{7}\u{202e}\u{9b}\u{7f}z"});
        let text = json_text(&serde_json::to_string_pretty(&v).unwrap());
        assert!(
            text.chars()
                .all(|c| c == '\n' || (!is_control(c) && !is_hidden_format(c))),
            "{text:?}"
        );
        let back: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back, v, "the same data");
    }

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

//! Small text helpers the rendered artifacts share (staging log, post-deploy log, lessons,
//! reports): RFC 3339 dates from epoch milliseconds without a clock or a time zone database,
//! Markdown table cells, one-line summaries; and which characters a terminal or a reader must
//! never be handed raw (control characters, invisible and direction-changing marks), with the
//! escaped form orch shows instead. Pure functions; the one place to fix a rendering rule.

/// Formats epoch milliseconds as RFC 3339 UTC with second precision (`2026-06-16T12:00:00Z`).
/// Pure arithmetic (no clock, no time zone database); the input is clamped to the years
/// 0000–9999 that RFC 3339 can express.
pub fn rfc3339_utc(ms: i64) -> String {
    const MIN_S: i64 = -62_167_219_200; // 0000-01-01T00:00:00Z
    const MAX_S: i64 = 253_402_300_799; // 9999-12-31T23:59:59Z
    let secs = ms.div_euclid(1_000).clamp(MIN_S, MAX_S);
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        sod / 3_600,
        sod % 3_600 / 60,
        sod % 60
    )
}

/// Days since 1970-01-01 → (year, month, day) in the proleptic Gregorian calendar
/// (H. Hinnant's `civil_from_days`).
pub fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// Makes text safe inside one Markdown table cell: `|` is escaped, line breaks become
/// `<br>`, HTML is neutralised, other control characters become spaces, and only the last
/// `max_chars` characters are kept (cells hold output *tails*). Empty text becomes `—`.
pub fn md_cell(s: &str, max_chars: usize) -> String {
    let total = s.chars().count();
    let skip = total.saturating_sub(max_chars);
    let mut out = String::new();
    if skip > 0 {
        out.push('…');
    }
    let text: String = s.chars().skip(skip).collect();
    let text = text.replace("\r\n", "\n");
    let text = text.trim_matches(|c| c == '\n' || c == ' ');
    for c in text.chars() {
        match c {
            '|' => out.push_str("\\|"),
            '\n' | '\r' => out.push_str("<br>"),
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            c if c.is_control() => out.push(' '),
            c => out.push(c),
        }
    }
    if out.is_empty() {
        out.push('—');
    }
    out
}

/// Collapses text to one line: every run of whitespace (line breaks included) becomes one
/// space, none at either end (for summaries, list items and messages).
pub fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// [`one_line`], at most `max` characters: a longer text ends in `…` within the bound.
pub fn one_line_max(s: &str, max: usize) -> String {
    let flat = one_line(s);
    if flat.chars().count() <= max {
        return flat;
    }
    let mut cut: String = flat.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// Whether a terminal may act on `c`: the C0 controls (line feed and tab included), DEL and
/// the C1 controls (Unicode category Cc). ESC starts every terminal escape sequence; 8-bit C1
/// (`U+009B` CSI, `U+009D` OSC) does the same on some terminals.
pub fn is_control(c: char) -> bool {
    c.is_control()
}

/// Whether `c` is invisible or changes the direction text is shown in, so that what a reader
/// sees is not what is there: the bidirectional marks, embeddings, overrides and isolates
/// (`U+200E`, `U+200F`, `U+202A`–`U+202E`, `U+2066`–`U+2069`, `U+061C`), the zero-width
/// space, the word joiner and invisible operators (`U+200B`, `U+2060`–`U+2064`) and the
/// byte-order mark (`U+FEFF`). The joiners `U+200C`/`U+200D`, which some scripts and emoji
/// need, are not among them.
pub fn is_hidden_format(c: char) -> bool {
    matches!(
        c,
        '\u{061C}'
            | '\u{200B}'
            | '\u{200E}'
            | '\u{200F}'
            | '\u{202A}'..='\u{202E}'
            | '\u{2060}'..='\u{2064}'
            | '\u{2066}'..='\u{2069}'
            | '\u{FEFF}'
    )
}

/// A Markdown fenced block holding `text` verbatim: the fence is longer than any run of
/// backticks inside, so the text cannot close it early (or open a block of its own).
pub fn fenced(lang: &str, text: &str) -> String {
    let mut longest = 0;
    let mut current = 0;
    for c in text.chars() {
        if c == '`' {
            current += 1;
            longest = longest.max(current);
        } else {
            current = 0;
        }
    }
    let fence = "`".repeat(longest.max(2) + 1);
    let body = if text.trim().is_empty() {
        "(no output)"
    } else {
        text.trim_end()
    };
    format!("{fence}{lang}\n{body}\n{fence}\n")
}

/// `bytes` (a file name, say) as text a terminal shows as it is: valid UTF-8 is kept except
/// for the characters of [`is_control`] and [`is_hidden_format`], written as escapes (`\n`,
/// `\t`, `\r`, `\u{1b}`, `\u{202e}`), and bytes that are not UTF-8 are written `\xNN`. A
/// backslash is doubled, so the escaped form reads back unambiguously.
pub fn escape_bytes(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        out.push_str(&escape(chunk.valid()));
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out
}

/// [`escape_bytes`] of a string.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if is_control(c) || is_hidden_format(c) => {
                out.push_str(&format!("\\u{{{:x}}}", u32::from(c)));
            }
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_terminal_must_not_be_handed_is_escaped() {
        let cases: [(&[u8], &str); 7] = [
            (b"plain/name.md", "plain/name.md"),
            (b"new\nline", "new\\nline"),
            (b"esc\x1b[2Jx", "esc\\u{1b}[2Jx"),
            ("rtl\u{202e}gpj.exe".as_bytes(), "rtl\\u{202e}gpj.exe"),
            (b"c1\xc2\x9b", "c1\\u{9b}"),
            (b"bad\xff\xfe", "bad\\xff\\xfe"),
            (b"back\\slash\x7f", "back\\\\slash\\u{7f}"),
        ];
        for (input, expect) in cases {
            assert_eq!(escape_bytes(input), expect, "{input:?}");
        }
        assert!(is_hidden_format('\u{2066}') && !is_hidden_format('\u{200D}'));
        assert!(is_control('\u{85}') && !is_control('é'));
    }

    #[test]
    fn dates_lines_and_cells() {
        assert_eq!(rfc3339_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339_utc(1_781_611_200_000), "2026-06-16T12:00:00Z");
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        assert_eq!(civil_from_days(59), (1970, 3, 1));
        assert_eq!(one_line("a\n  b\r\n\nc"), "a b c");
        assert_eq!(one_line("  a \t b  "), "a b");
        assert_eq!(one_line_max("a  b", 3), "a b");
        assert_eq!(one_line_max("abcd", 3), "ab…");
        assert_eq!(md_cell("x|y\nz", 100), "x\\|y<br>z");
        assert_eq!(md_cell("", 10), "—");
    }
}

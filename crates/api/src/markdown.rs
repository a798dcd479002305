//! Artifacts rendered for the dashboard: the `---` frontmatter split off and shown as text, the
//! body rendered from Markdown by pulldown-cmark with raw HTML escaped (shown as text, never
//! interpreted) and links kept only for safe schemes (`http`, `https`, `mailto`, relative
//! paths and fragments). Images become links, so a page never loads anything from elsewhere.

use pulldown_cmark::{CowStr, Event, Options, Parser, Tag, TagEnd};

/// An artifact split into frontmatter text and rendered body HTML.
pub(crate) struct Rendered {
    /// The frontmatter's YAML text (empty when there is none).
    pub frontmatter: String,
    /// Safe HTML of the body.
    pub html: String,
}

/// Splits the frontmatter off and renders the body.
pub(crate) fn render_artifact(text: &str) -> Rendered {
    let (frontmatter, body) = split_frontmatter(text);
    Rendered {
        frontmatter: frontmatter.to_owned(),
        html: to_safe_html(body),
    }
}

fn split_frontmatter(text: &str) -> (&str, &str) {
    let Some(rest) = text.strip_prefix("---\n") else {
        return ("", text);
    };
    match rest.find("\n---\n") {
        Some(end) => (&rest[..end], &rest[end + 5..]),
        None => match rest.strip_suffix("\n---") {
            Some(fm) => (fm, ""),
            None => ("", text),
        },
    }
}

/// Whether a link target may be followed from the dashboard.
fn safe_url(url: &str) -> bool {
    let u = url.trim();
    let lower = u.to_ascii_lowercase();
    // A scheme is what comes before the first ':' when no '/', '?' or '#' precedes it.
    let scheme_end = lower.find(':');
    let path_start = lower.find(['/', '?', '#']);
    match (scheme_end, path_start) {
        (Some(c), Some(p)) if p < c => true,
        (Some(_), _) => {
            lower.starts_with("http://")
                || lower.starts_with("https://")
                || lower.starts_with("mailto:")
        }
        (None, _) => !u.chars().any(char::is_control),
    }
}

/// The text without one-line HTML comments (`<!-- … -->`) outside fenced code: markers for
/// tools, hidden as a browser would hide them.
fn without_comments(markdown: &str) -> String {
    let mut out = String::with_capacity(markdown.len());
    let mut fenced = false;
    for line in markdown.split_inclusive('\n') {
        let t = line.trim_start();
        if t.starts_with("```") || t.starts_with("~~~") {
            fenced = !fenced;
        }
        if fenced || !line.contains("<!--") {
            out.push_str(line);
            continue;
        }
        let mut rest = line;
        while let Some(start) = rest.find("<!--") {
            match rest[start + 4..].find("-->") {
                Some(len) => {
                    out.push_str(&rest[..start]);
                    rest = rest[start + 4 + len + 3..].trim_start_matches(' ');
                }
                None => break,
            }
        }
        out.push_str(rest);
    }
    out
}

/// Whether raw HTML is nothing but one comment.
fn is_comment(h: &str) -> bool {
    let t = h.trim();
    t.starts_with("<!--") && t.ends_with("-->") && !t[4..t.len() - 3].contains("-->")
}

/// Markdown to HTML that cannot run script: raw HTML is turned into text, unsafe link
/// targets are dropped, images become links.
pub(crate) fn to_safe_html(markdown: &str) -> String {
    let markdown = &without_comments(markdown);
    let opts = Options::ENABLE_TABLES | Options::ENABLE_STRIKETHROUGH | Options::ENABLE_TASKLISTS;
    let mut in_image = false;
    let events = Parser::new_ext(markdown, opts).filter_map(|ev| match ev {
        // HTML comments are markers for tools (the lessons file has one per entry): hidden, as
        // a browser would hide them; any other raw HTML is shown as text.
        Event::Html(h) | Event::InlineHtml(h) if is_comment(&h) => None,
        Event::Html(h) | Event::InlineHtml(h) => Some(Event::Text(h)),
        Event::Start(Tag::Link {
            link_type,
            dest_url,
            title,
            id,
        }) => {
            let dest_url = if safe_url(&dest_url) {
                dest_url
            } else {
                CowStr::Borrowed("#unsafe-link-removed")
            };
            Some(Event::Start(Tag::Link {
                link_type,
                dest_url,
                title,
                id,
            }))
        }
        Event::Start(Tag::Image {
            link_type,
            dest_url,
            title,
            id,
        }) => {
            in_image = true;
            let dest_url = if safe_url(&dest_url) {
                dest_url
            } else {
                CowStr::Borrowed("#unsafe-link-removed")
            };
            Some(Event::Start(Tag::Link {
                link_type,
                dest_url,
                title,
                id,
            }))
        }
        Event::End(TagEnd::Image) if in_image => {
            in_image = false;
            Some(Event::End(TagEnd::Link))
        }
        other => Some(other),
    });
    let mut out = String::with_capacity(markdown.len() * 3 / 2);
    pulldown_cmark::html::push_html(&mut out, events);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_html_is_text_and_unsafe_links_are_dropped() {
        for (md, must, must_not) in [
            ("<script>alert(1)</script>", "&lt;script&gt;", "<script"),
            ("a <b onclick=x>b</b>", "&lt;b onclick=x&gt;", "<b "),
            (
                "[x](javascript:alert(1))",
                "#unsafe-link-removed",
                "javascript:",
            ),
            (
                "[x]( JaVaScRiPt:alert(1))",
                "#unsafe-link-removed",
                "alert(1)\"",
            ),
            ("[x](data:text/html,hi)", "#unsafe-link-removed", "data:"),
            (
                "[x](https://example.com/a)",
                "href=\"https://example.com/a\"",
                "unsafe",
            ),
            ("[x](docs/a.md#b)", "href=\"docs/a.md#b\"", "unsafe"),
            (
                "![i](https://x/y.png)",
                "<a href=\"https://x/y.png\"",
                "<img",
            ),
            ("| a | b |\n|---|---|\n| 1 | 2 |\n", "<table>", "<script"),
            ("# Title\n\n**bold**", "<strong>bold</strong>", "<script"),
            (
                "- <!-- marker --> **A-1** lesson",
                "<strong>A-1</strong> lesson",
                "marker",
            ),
            ("<!-- a --> <script>x</script>", "&lt;script&gt;", "<script"),
        ] {
            let html = to_safe_html(md);
            assert!(html.contains(must), "{md:?} -> {html}");
            assert!(!html.contains(must_not), "{md:?} -> {html}");
        }
    }

    #[test]
    fn frontmatter_is_split_off() {
        let r = render_artifact("---\nwork_item: A-1\nstatus: x\n---\n# Body\n");
        assert_eq!(r.frontmatter, "work_item: A-1\nstatus: x");
        assert!(r.html.contains("<h1>Body</h1>"), "{}", r.html);
        let r = render_artifact("# no frontmatter\n");
        assert!(r.frontmatter.is_empty());
        assert!(r.html.contains("<h1>"));
    }
}

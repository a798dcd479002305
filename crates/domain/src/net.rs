//! Network endpoints as orch's configuration names them (`host:port`, or a URL's), for the
//! sandbox's allowlists: parsed and validated here, once, so a configuration error names the
//! entry and the rule.

/// Variables holding orch's own secrets: never passed to any child, whatever a configuration
/// names.
pub const SECRET_VARS: [&str; 4] = [
    "ORCH_TOKEN",
    "ORCH_DATABASE_URL",
    "DATABASE_URL",
    "ORCH_TEST_PG_URL",
];

/// One endpoint of an allowlist: a host name or IP address and a TCP port.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct Endpoint {
    /// Host name or IP address (IPv6 without brackets).
    pub host: String,
    /// TCP port.
    pub port: u16,
}

impl Endpoint {
    /// Parses `host:port` (`[v6]:port` for IPv6).
    pub fn parse(text: &str) -> Result<Endpoint, String> {
        let text = text.trim();
        let (host, port) = match text.strip_prefix('[') {
            Some(rest) => {
                let (host, port) = rest
                    .split_once("]:")
                    .ok_or_else(|| format!("`{text}`: expected [address]:port"))?;
                (host, port)
            }
            None => text
                .rsplit_once(':')
                .ok_or_else(|| format!("`{text}`: expected host:port"))?,
        };
        let port: u16 = port
            .parse()
            .map_err(|_| format!("`{text}`: the port must be a number from 1 to 65535"))?;
        if port == 0 {
            return Err(format!(
                "`{text}`: the port must be a number from 1 to 65535"
            ));
        }
        let valid = !host.is_empty()
            && host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '_'));
        if !valid {
            return Err(format!("`{text}`: `{host}` is not a host name or address"));
        }
        Ok(Endpoint {
            host: host.to_ascii_lowercase(),
            port,
        })
    }

    /// The endpoint of a URL (`http://host:port/…`, the scheme's port when none is given).
    pub fn of_url(url: &str) -> Result<Endpoint, String> {
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| format!("`{url}` is not a URL"))?;
        let default_port = match scheme.to_ascii_lowercase().as_str() {
            "http" | "ws" => 80,
            "https" | "wss" => 443,
            other => return Err(format!("`{url}`: unsupported scheme `{other}`")),
        };
        let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
        let authority = authority.rsplit('@').next().unwrap_or_default();
        let has_port = match authority.strip_prefix('[') {
            Some(v6) => v6.contains("]:"),
            None => authority.contains(':'),
        };
        if has_port {
            Endpoint::parse(authority)
        } else {
            let host = authority.trim_start_matches('[').trim_end_matches(']');
            Endpoint::parse(&format!("[{host}]:{default_port}"))
        }
    }

    /// True for `localhost` and loopback addresses: reachable inside the sandbox at the same
    /// address.
    pub fn is_loopback(&self) -> bool {
        self.host == "localhost"
            || self
                .host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback())
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_from_text_and_urls() {
        let check = |text: &str, want: Result<(&str, u16), ()>| {
            let got = Endpoint::parse(text)
                .map(|e| (e.host, e.port))
                .map_err(|_| ());
            assert_eq!(got, want.map(|(h, p)| (h.to_owned(), p)), "{text}");
        };
        check("127.0.0.1:8080", Ok(("127.0.0.1", 8080)));
        check("API.Anthropic.com:443", Ok(("api.anthropic.com", 443)));
        check("[::1]:9", Ok(("::1", 9)));
        check("host", Err(()));
        check("host:0", Err(()));
        check("host:99999", Err(()));
        check("a b:1", Err(()));
        check(":80", Err(()));
        let url = |u: &str| Endpoint::of_url(u).map(|e| e.to_string());
        assert_eq!(
            url("https://api.openai.com/v1").as_deref(),
            Ok("api.openai.com:443")
        );
        assert_eq!(
            url("http://127.0.0.1:4000/v1").as_deref(),
            Ok("127.0.0.1:4000")
        );
        assert_eq!(
            url("http://user:pw@example.com").as_deref(),
            Ok("example.com:80")
        );
        assert_eq!(url("http://[::1]:5/x").as_deref(), Ok("[::1]:5"));
        assert!(url("ftp://x").is_err());
        assert!(Endpoint::parse("localhost:1").unwrap().is_loopback());
        assert!(!Endpoint::parse("10.0.0.1:1").unwrap().is_loopback());
    }
}

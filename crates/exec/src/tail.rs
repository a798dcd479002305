//! A bounded capture of a stream: the last `limit` bytes plus the count of all bytes seen, so a
//! child that prints gigabytes costs at most about twice `limit` bytes of memory.

/// The tail of a byte stream.
#[derive(Debug)]
pub(crate) struct Tail {
    limit: usize,
    buf: Vec<u8>,
    total: u64,
}

impl Tail {
    pub(crate) fn new(limit: usize) -> Tail {
        Tail {
            limit,
            buf: Vec::new(),
            total: 0,
        }
    }

    /// Appends a chunk, dropping the oldest bytes once the buffer holds twice the limit
    /// (amortised: each byte is moved at most once).
    pub(crate) fn push(&mut self, chunk: &[u8]) {
        self.total += chunk.len() as u64;
        if chunk.len() >= self.limit {
            self.buf.clear();
            self.buf
                .extend_from_slice(&chunk[chunk.len() - self.limit..]);
            return;
        }
        self.buf.extend_from_slice(chunk);
        if self.buf.len() > self.limit.saturating_mul(2) {
            let excess = self.buf.len() - self.limit;
            self.buf.drain(..excess);
        }
    }

    /// The last `limit` bytes and the total number of bytes pushed.
    pub(crate) fn finish(mut self) -> (Vec<u8>, u64) {
        if self.buf.len() > self.limit {
            let excess = self.buf.len() - self.limit;
            self.buf.drain(..excess);
        }
        (self.buf, self.total)
    }
}

#[cfg(test)]
mod tests {
    use super::Tail;

    fn check(limit: usize, chunks: &[&str], expect_tail: &str, expect_total: u64) {
        let mut tail = Tail::new(limit);
        for chunk in chunks {
            tail.push(chunk.as_bytes());
        }
        let (bytes, total) = tail.finish();
        assert_eq!(
            String::from_utf8(bytes).unwrap(),
            expect_tail,
            "limit {limit} chunks {chunks:?}"
        );
        assert_eq!(total, expect_total, "limit {limit} chunks {chunks:?}");
    }

    #[test]
    fn keeps_the_last_bytes_and_counts_all() {
        check(5, &[], "", 0);
        check(5, &["abc"], "abc", 3);
        check(5, &["abc", "def"], "bcdef", 6);
        check(5, &["abcdefgh"], "defgh", 8);
        check(
            5,
            &["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l"],
            "hijkl",
            12,
        );
        check(5, &["abcdefghij", "xy"], "hijxy", 12);
        check(0, &["abc", "def"], "", 6);
        check(3, &["ab", "", "cd"], "bcd", 4);
    }
}

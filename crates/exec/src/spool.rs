//! A child's stdout or stderr as an unlinked temporary file that the run tails, never a pipe.
//!
//! Why not a pipe: a child whose parent died (orch killed -9) keeps running until the next
//! incarnation stops it; writing to a pipe with no reader kills it with SIGPIPE at an arbitrary
//! point, half-way through a deploy. A file has no reader to lose: the child's writes always
//! succeed, and the file vanishes when the last descriptor closes.
//!
//! The file is opened `O_APPEND` and read with positioned reads (`pread`), so the child's writes
//! and the tailer's reads never share an offset. To bound the disk a chatty child can use, a
//! file that grew past [`SPOOL_MAX`] is read to its end and truncated to zero; bytes the child
//! writes between that read and the truncation are lost from the capture (only ever in the
//! middle of output larger than `SPOOL_MAX`; the tail and the byte count stay right otherwise).

use std::fs::File;
use std::io::{self, Seek as _, Write as _};
use std::os::fd::AsRawFd as _;
use std::os::unix::fs::FileExt as _;
use std::process::Stdio;

use crate::tail::Tail;

/// Size past which a spool file is truncated once it has been read.
pub(crate) const SPOOL_MAX: u64 = 16 * 1024 * 1024;
/// Bytes read per positioned read.
const READ_CHUNK: usize = 64 * 1024;

/// One captured output stream.
#[derive(Debug)]
pub(crate) struct Spool {
    file: File,
    pos: u64,
    tail: Tail,
    /// Gets each chunk read, in order.
    pub(crate) sink: Option<crate::process::OutputSink>,
}

impl Spool {
    /// An empty spool in the temporary directory, keeping the last `limit` bytes.
    pub(crate) fn new(limit: usize) -> io::Result<Spool> {
        let file = tempfile::tempfile()?;
        set_append(&file)?;
        Ok(Spool {
            file,
            pos: 0,
            tail: Tail::new(limit),
            sink: None,
        })
    }

    /// The descriptor the child writes to.
    pub(crate) fn child_end(&self) -> io::Result<Stdio> {
        Ok(Stdio::from(self.file.try_clone()?))
    }

    /// Reads what the child wrote since the last call, up to `budget` bytes (so one call never
    /// holds a runtime thread for long); truncates a file that grew past [`SPOOL_MAX`].
    /// Returns whether it stopped at the end of the file.
    pub(crate) fn read_new(&mut self, budget: usize) -> io::Result<bool> {
        let mut buf = vec![0u8; READ_CHUNK];
        let mut read = 0;
        loop {
            let n = match self.file.read_at(&mut buf, self.pos) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if n == 0 {
                if self.pos > SPOOL_MAX {
                    self.file.set_len(0)?;
                    self.pos = 0;
                }
                return Ok(true);
            }
            self.tail.push(&buf[..n]);
            if let Some(sink) = &self.sink {
                (sink.0)(&buf[..n]);
            }
            self.pos += n as u64;
            read += n;
            if read >= budget {
                return Ok(false);
            }
        }
    }

    /// The kept tail and the number of bytes seen.
    pub(crate) fn finish(self) -> (Vec<u8>, u64) {
        self.tail.finish()
    }
}

/// A temporary file holding `data`, positioned at its start: a child's stdin.
pub(crate) fn input(data: &[u8]) -> io::Result<Stdio> {
    let mut file = tempfile::tempfile()?;
    file.write_all(data)?;
    file.rewind()?;
    Ok(Stdio::from(file))
}

fn set_append(file: &File) -> io::Result<()> {
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor this function borrows; no memory is passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_APPEND) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn append(spool: &Spool, bytes: &[u8]) {
        let mut writer = spool.file.try_clone().unwrap();
        writer.write_all(bytes).unwrap();
    }

    #[test]
    fn reads_what_is_appended_and_truncates_past_the_cap() {
        let mut spool = Spool::new(8).unwrap();
        append(&spool, b"hello ");
        assert!(spool.read_new(usize::MAX).unwrap());
        append(&spool, b"world");
        assert!(spool.read_new(usize::MAX).unwrap());
        // Past the cap: read to the end, then the file starts over; appends land at 0.
        let big = vec![b'x'; usize::try_from(SPOOL_MAX).unwrap() + 1];
        append(&spool, &big);
        while !spool.read_new(1 << 20).unwrap() {}
        assert_eq!(spool.file.metadata().unwrap().len(), 0, "truncated");
        append(&spool, b"the end");
        assert!(spool.read_new(usize::MAX).unwrap());
        let (tail, total) = spool.finish();
        assert_eq!(tail, b"xthe end");
        assert_eq!(total, 11 + SPOOL_MAX + 1 + 7);
    }
}

//! How the commands write files, so that none fails silently or leaves a half-written file:
//!
//! - [`write_atomic`] (and [`replace_with`] for writers that need a path): the file is written to
//!   a temporary file in the same directory and renamed into place only once every write and the
//!   flush succeeded; on any error the temporary file is removed and the destination is left as
//!   it was. Errors name the destination.
//! - [`Append`]: a file that grows while a command runs (a sampled data set, `metrics.jsonl`,
//!   `iterations.jsonl`): every write is checked and flushed, and its error names the file, so a
//!   full disk stops the command at once.
//! - [`Lock`]: a directory (or file) in use by a run: `LOCK` (or `FILE.lock`) holding the
//!   holder's pid, host, start time and command line; a second run is refused naming the holder,
//!   a lock left by a process that no longer exists is taken over.
//! - [`refuse_overlap`]: an output that is, contains or lies inside an input model directory.

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Component, Path, PathBuf};

/// Refuses a destination that exists and is not a regular file (a device such as `/dev/full` or
/// `/dev/null`, a directory), which a rename would replace or a read would never finish.
pub fn refuse_special(path: &Path) -> Result<()> {
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => bail!("{} exists and is not a regular file", path.display()),
        _ => Ok(()),
    }
}

/// Refuses an input that is a device (`/dev/zero`, `/dev/full`, ...), which a whole-file read
/// would read without end.
pub fn refuse_device(path: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if let Ok(m) = std::fs::metadata(path) {
            if m.file_type().is_char_device() || m.file_type().is_block_device() {
                bail!("{} is a device, not a data file", path.display());
            }
        }
    }
    Ok(())
}

/// The path a rename must replace: a symbolic link's target (so that the link stays a link).
fn destination(path: &Path) -> PathBuf {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf()),
        _ => path.to_path_buf(),
    }
}

/// A temporary path beside `path`, with the same extension (some writers choose the format by
/// it): `dir/.NAME.tmp-PID.EXT`.
fn temporary(path: &Path) -> Result<PathBuf> {
    let name = path.file_name().with_context(|| format!("{} names no file", path.display()))?;
    let ext = path.extension().map(|e| format!(".{}", e.to_string_lossy())).unwrap_or_default();
    let tmp = format!(".{}.tmp-{}{ext}", name.to_string_lossy(), std::process::id());
    Ok(path.with_file_name(tmp))
}

/// Calls `write` with a temporary path beside `path`, then renames that file onto `path`. If
/// `write` fails (or the rename does), the temporary file is removed, `path` is left as it was,
/// and the error names `path`.
pub fn replace_with<T>(path: &Path, write: impl FnOnce(&Path) -> Result<T>) -> Result<T> {
    refuse_special(path)?;
    let path = destination(path);
    let tmp = temporary(&path)?;
    let result = write(&tmp).and_then(|v| {
        std::fs::rename(&tmp, &path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
        Ok(v)
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.with_context(|| format!("writing {}", path.display()))
}

/// Writes `path` atomically: `write` writes to a buffered temporary file beside it, which is
/// flushed, synced and renamed onto `path` only if everything succeeded (see [`replace_with`]).
pub fn write_atomic<T>(path: &Path, write: impl FnOnce(&mut BufWriter<File>) -> Result<T>) -> Result<T> {
    replace_with(path, |tmp| {
        let file = File::create(tmp).with_context(|| format!("creating {}", tmp.display()))?;
        let mut w = BufWriter::new(file);
        let v = write(&mut w)?;
        let file = w.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        Ok(v)
    })
}

/// [`write_atomic`] of a whole byte string.
pub fn write_file(path: &Path, bytes: impl AsRef<[u8]>) -> Result<()> {
    write_atomic(path, |w| Ok(w.write_all(bytes.as_ref())?))
}

/// A file written as a command runs, one record at a time: every write is checked and flushed,
/// and an error names the file.
pub struct Append {
    path: PathBuf,
    file: File,
}

impl Append {
    /// Opens `path` for appending, creating it if needed.
    pub fn open(path: &Path) -> Result<Self> {
        refuse_special(path)?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening {} for writing", path.display()))?;
        Ok(Self { path: path.to_path_buf(), file })
    }

    /// Appends `bytes` (whole records: the caller buffers at most one batch) and flushes them.
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.file
            .write_all(bytes)
            .and_then(|()| self.file.flush())
            .with_context(|| format!("writing {}", self.path.display()))
    }

    /// Appends one line (`line` and a newline).
    pub fn line(&mut self, line: &str) -> Result<()> {
        let mut bytes = Vec::with_capacity(line.len() + 1);
        bytes.extend_from_slice(line.as_bytes());
        bytes.push(b'\n');
        self.write(&bytes)
    }
}

/// `path` with `suffix` appended to its file name (`data.jsonl` → `data.jsonl.lock`).
pub fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(suffix);
    path.with_file_name(name)
}

/// Who holds a [`Lock`]: written into the lock file as one JSON line.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Holder {
    pub pid: u32,
    pub host: String,
    /// The process's start time (clock ticks after boot, `/proc/PID/stat`), so that a pid
    /// reused by another process does not keep a stale lock alive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<u64>,
    pub command: String,
}

/// The host's name (`/proc/sys/kernel/hostname`, else `$HOSTNAME`).
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// The fields of `/proc/PID/stat` after the command name (field 3, the state, first), where
/// there is a `/proc`.
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: count after its end.
    let rest = &stat[stat.rfind(')')? + 1..];
    Some(rest.split_whitespace().map(String::from).collect())
}

/// The start time of process `pid` (field 22 of `/proc/PID/stat`).
fn start_time(pid: u32) -> Option<u64> {
    stat_fields(pid)?.get(19)?.parse().ok()
}

/// Whether process `pid` is ending: a zombie or dead (state `Z`, `X`), or with SIGKILL pending
/// (killed, and releasing its memory before it becomes a zombie: it will not run again).
fn is_ending(pid: u32) -> bool {
    let state = stat_fields(pid).and_then(|f| f.first().cloned()).unwrap_or_default();
    if state == "Z" || state == "X" {
        return true;
    }
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else { return false };
    // SIGKILL is signal 9: bit 8 of the pending masks (per thread and shared), in hex.
    status
        .lines()
        .filter(|l| l.starts_with("SigPnd:") || l.starts_with("ShdPnd:"))
        .filter_map(|l| u64::from_str_radix(l.split_whitespace().nth(1)?, 16).ok())
        .any(|mask| mask & (1 << 8) != 0)
}

impl Holder {
    fn this_process() -> Self {
        let pid = std::process::id();
        Self { pid, host: host_name(), start: start_time(pid), command: std::env::args().collect::<Vec<_>>().join(" ") }
    }

    /// Whether the holder is known to be gone: on this host, where `/proc` exists, no process
    /// `pid`, one started at another time, or one that is ending (killed, or a zombie: a rerun
    /// right after a kill takes the lock over). A holder on another host is never known gone.
    fn is_gone(&self) -> bool {
        if self.host != host_name() || !Path::new("/proc/self").exists() {
            return false;
        }
        if !Path::new(&format!("/proc/{}", self.pid)).exists() {
            return true;
        }
        matches!((self.start, start_time(self.pid)), (Some(a), Some(b)) if a != b) || is_ending(self.pid)
    }
}

/// A directory (or an output file) in use by this process: the lock file exists for as long as
/// the value lives (it is removed when dropped, on success, error or panic).
#[derive(Debug)]
pub struct Lock {
    path: PathBuf,
}

impl Lock {
    /// Locks directory `dir` (which must exist) with `dir/LOCK`.
    pub fn dir(dir: &Path) -> Result<Self> {
        Self::acquire(&dir.join("LOCK"), dir)
    }

    /// Locks the output file `file` with `FILE.lock` beside it.
    pub fn file(file: &Path) -> Result<Self> {
        Self::acquire(&with_suffix(file, ".lock"), file)
    }

    /// Creates `lock` (refusing if another live process holds it; taking it over, with a note on
    /// stderr, if its holder is gone). `what` names the locked thing in messages.
    pub fn acquire(lock: &Path, what: &Path) -> Result<Self> {
        let me = Holder::this_process();
        for _ in 0..3 {
            match std::fs::OpenOptions::new().write(true).create_new(true).open(lock) {
                Ok(mut f) => {
                    if let Err(e) = writeln!(f, "{}", serde_json::to_string(&me)?).and_then(|()| f.flush()) {
                        let _ = std::fs::remove_file(lock);
                        return Err(e).with_context(|| format!("writing {}", lock.display()));
                    }
                    return Ok(Self { path: lock.to_path_buf() });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e).with_context(|| format!("creating the lock {}", lock.display())),
            }
            let text = std::fs::read_to_string(lock).unwrap_or_default();
            let holder = serde_json::from_str::<Holder>(text.trim()).ok();
            match holder {
                Some(h) if h.is_gone() => {
                    eprintln!(
                        "note: taking over {}: its holder (pid {} on {}, `{}`) no longer runs",
                        lock.display(),
                        h.pid,
                        h.host,
                        h.command
                    );
                    // Another process may take it over first: then create_new fails again and
                    // that process is named.
                    let _ = std::fs::remove_file(lock);
                }
                Some(h) => bail!(
                    "{} is in use by process {} on {} (`{}`): wait for it to finish, or remove {} if that process is gone",
                    what.display(),
                    h.pid,
                    h.host,
                    h.command,
                    lock.display()
                ),
                None => bail!(
                    "{} is in use ({} exists and names no holder yet): wait for that run, or remove the lock if none runs",
                    what.display(),
                    lock.display()
                ),
            }
        }
        bail!("{} is in use: could not take over {}", what.display(), lock.display())
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        // Only our own lock: never one another process created after taking it over.
        let ours = std::fs::read_to_string(&self.path)
            .ok()
            .and_then(|t| serde_json::from_str::<Holder>(t.trim()).ok())
            .is_some_and(|h| h.pid == std::process::id() && h.host == host_name());
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// `path` made absolute with symbolic links resolved, also when it does not exist yet: its
/// deepest existing ancestor canonicalised, then the rest of its components (`..` and `.`
/// applied).
pub fn canonical(path: &Path) -> Result<PathBuf> {
    if let Ok(p) = std::fs::canonicalize(path) {
        return Ok(p);
    }
    let absolute = if path.is_absolute() { path.to_path_buf() } else { std::env::current_dir()?.join(path) };
    let mut existing = absolute.as_path();
    let mut rest = vec![];
    while std::fs::symlink_metadata(existing).is_err() {
        let Some(parent) = existing.parent() else { break };
        rest.push(existing.file_name().map(|n| n.to_os_string()));
        existing = parent;
    }
    let mut out = std::fs::canonicalize(existing).unwrap_or_else(|_| existing.to_path_buf());
    for c in rest.into_iter().rev() {
        match c {
            Some(name) => out.push(name),
            None => {
                out.pop();
            }
        }
    }
    // `..` and `.` left in the missing part.
    let mut clean = PathBuf::new();
    for c in out.components() {
        match c {
            Component::ParentDir => {
                clean.pop();
            }
            Component::CurDir => {}
            other => clean.push(other),
        }
    }
    Ok(clean)
}

/// Refuses an output path (`what_out`: a directory or a file) that is the input model directory
/// `model`, lies inside it, or contains it: a run must never write into its own input.
pub fn refuse_overlap(model: &Path, out: &Path, what_out: &str) -> Result<()> {
    let (m, o) = (canonical(model)?, canonical(out)?);
    let relation = if m == o {
        "is"
    } else if o.starts_with(&m) {
        "lies inside"
    } else if m.starts_with(&o) {
        "contains"
    } else {
        return Ok(());
    };
    bail!(
        "the {what_out} {} {relation} the input model directory {}: a run never writes into its own input; choose another {what_out}",
        out.display(),
        model.display()
    )
}

/// Drops a last line that has no end of line (cut short by an interrupted append, possibly inside
/// a character) from the bytes of a line-based file; whether there was one.
pub fn drop_cut_line(bytes: &mut Vec<u8>) -> bool {
    if bytes.last().is_none_or(|&b| b == b'\n') {
        return false;
    }
    bytes.truncate(bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1));
    true
}

/// Whether `dir` holds a whole model: its `config.json`, which `checkpoint::save` writes last, so
/// that weights a kill left without it are not taken for a finished model.
pub fn holds_model(dir: &Path) -> bool {
    dir.join("config.json").exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("topr-llama-io-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn weights_without_their_config_are_no_model() {
        // `checkpoint::save` writes config.json last: weights a kill left alone are no model.
        let d = scratch("holds");
        write_file(&d.join("model.safetensors"), "weights").unwrap();
        assert!(!holds_model(&d));
        write_file(&d.join("config.json"), "{}").unwrap();
        assert!(holds_model(&d));
    }

    #[test]
    fn a_failed_atomic_write_leaves_the_destination_as_it_was() {
        let d = scratch("atomic");
        let p = d.join("a.json");
        write_file(&p, "old").unwrap();
        let err = write_atomic(&p, |w| -> Result<()> {
            w.write_all(b"half")?;
            bail!("disk full")
        })
        .unwrap_err();
        assert!(format!("{err:#}").contains("a.json") && format!("{err:#}").contains("disk full"), "{err:#}");
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "old");
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1, "the temporary file is removed");
        write_file(&p, "new").unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "new");
        assert!(refuse_special(Path::new("/dev/null")).is_err());
        assert!(write_file(Path::new("/dev/null"), "x").is_err());
        assert!(refuse_device(Path::new("/dev/zero")).is_err() && refuse_device(&p).is_ok());
    }

    #[test]
    fn paths_that_do_not_exist_yet_are_compared_by_their_existing_parent() {
        let d = scratch("canonical");
        std::fs::create_dir_all(d.join("m")).unwrap();
        let c = canonical(&d.join("x/../m/./new")).unwrap();
        assert_eq!(c, std::fs::canonicalize(d.join("m")).unwrap().join("new"));
        assert!(refuse_overlap(&d.join("m"), &d.join("m"), "output directory").is_err());
        assert!(refuse_overlap(&d.join("m"), &d.join("m/sub/x"), "output directory").is_err());
        assert!(refuse_overlap(&d.join("m"), &d, "output directory").is_err());
        assert!(refuse_overlap(&d.join("m"), &d.join("m2"), "output directory").is_ok());
    }

    #[test]
    fn locks_refuse_a_live_holder_and_take_over_a_gone_one() {
        let d = scratch("lock");
        let lock = Lock::dir(&d).unwrap();
        let err = Lock::dir(&d).unwrap_err().to_string();
        assert!(err.contains(&format!("process {}", std::process::id())), "{err}");
        drop(lock);
        assert!(!d.join("LOCK").exists());
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let gone = child.id();
        child.wait().unwrap();
        let h = Holder { pid: gone, host: host_name(), start: None, command: "llama train".into() };
        std::fs::write(d.join("LOCK"), serde_json::to_string(&h).unwrap()).unwrap();
        let taken = Lock::dir(&d).unwrap();
        drop(taken);
        // A killed holder that has not been reaped yet (a zombie) is gone too; a live one is not.
        let mut child = std::process::Command::new("sleep").arg("100").spawn().unwrap();
        let h =
            Holder { pid: child.id(), host: host_name(), start: start_time(child.id()), command: "llama train".into() };
        std::fs::write(d.join("LOCK"), serde_json::to_string(&h).unwrap()).unwrap();
        assert!(Lock::dir(&d).is_err(), "a live holder's lock was taken");
        child.kill().unwrap();
        let t0 = std::time::Instant::now();
        while !is_ending(child.id()) && t0.elapsed().as_secs() < 10 {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let _taken = Lock::dir(&d).unwrap();
        child.wait().unwrap();
    }
}

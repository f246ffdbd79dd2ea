//! Append-only JSON-lines logs (the self-generated training data), read without holding them
//! in memory.
//!
//! A run appends one line per finished answer, so a killed run leaves at most a torn last line.
//! [`LineIndex::recover`] cuts that line off (appending then continues from a clean end), parses
//! every complete line once, streaming, and keeps only where each line lies and a small key the
//! caller takes from it; training then reads each step's lines back with [`LineIndex::read`].
//! Memory grows with the number of lines, not with the tokens they hold: a data set of many
//! millions of tokens costs a few bytes per sequence.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::de::DeserializeOwned;

use crate::error::{Result, TrainError};

/// Where each complete line of a JSON-lines file lies, with a key per line.
#[derive(Debug)]
pub struct LineIndex<K> {
    path: PathBuf,
    /// Opened on the first read, shared by later ones.
    file: Mutex<Option<File>>,
    lines: Vec<Line<K>>,
}

#[derive(Debug)]
struct Line<K> {
    key: K,
    offset: u64,
    len: usize,
}

impl<K> LineIndex<K> {
    /// Indexes `path`, parsing each complete non-blank line as a `T` and keeping `key(&T)` for
    /// it; a torn last line (no final newline) is cut off the file. A missing file is an empty
    /// index; a line that does not parse is an error naming it.
    pub fn recover<T: DeserializeOwned>(path: &Path, mut key: impl FnMut(&T) -> K) -> Result<Self> {
        let mut index = LineIndex {
            path: path.to_path_buf(),
            file: Mutex::new(None),
            lines: Vec::new(),
        };
        let file = match File::open(path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(index),
            Err(e) => return Err(TrainError::io(path, e)),
        };
        let mut reader = BufReader::new(file);
        let (mut offset, mut buffer, mut number) = (0u64, Vec::new(), 0usize);
        loop {
            buffer.clear();
            let read = reader
                .read_until(b'\n', &mut buffer)
                .map_err(|e| TrainError::io(path, e))?;
            if read == 0 {
                break;
            }
            if buffer.last() != Some(&b'\n') {
                // A torn last line: cut it off so that appending starts a fresh line.
                let file = std::fs::OpenOptions::new()
                    .write(true)
                    .open(path)
                    .map_err(|e| TrainError::io(path, e))?;
                file.set_len(offset).map_err(|e| TrainError::io(path, e))?;
                break;
            }
            number += 1;
            if !buffer.iter().all(u8::is_ascii_whitespace) {
                let record: T = parse(path, number, &buffer)?;
                index.lines.push(Line {
                    key: key(&record),
                    offset,
                    len: read,
                });
            }
            offset += read as u64;
        }
        Ok(index)
    }

    /// Number of indexed lines.
    pub fn len(&self) -> usize {
        self.lines.len()
    }

    /// Whether no line is indexed.
    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }

    /// The key of line `i`.
    pub fn key(&self, i: usize) -> Option<&K> {
        self.lines.get(i).map(|l| &l.key)
    }

    /// The keys of all lines, in file order.
    pub fn keys(&self) -> impl ExactSizeIterator<Item = &K> {
        self.lines.iter().map(|l| &l.key)
    }

    /// Reads line `i` back from the file and parses it (an error if the file changed under the
    /// index so that it no longer parses).
    pub fn read<T: DeserializeOwned>(&self, i: usize) -> Result<T> {
        let line = self.lines.get(i).ok_or_else(|| {
            TrainError::InvalidConfig(format!(
                "line {i} of {} indexed in {}",
                self.lines.len(),
                self.path.display()
            ))
        })?;
        let mut bytes = vec![0u8; line.len];
        {
            // A poisoned lock only means another reader panicked mid-read; the handle is fine.
            let mut guard = self.file.lock().unwrap_or_else(|e| e.into_inner());
            if guard.is_none() {
                *guard = Some(File::open(&self.path).map_err(|e| TrainError::io(&self.path, e))?);
            }
            if let Some(file) = guard.as_mut() {
                file.seek(SeekFrom::Start(line.offset))
                    .and_then(|_| file.read_exact(&mut bytes))
                    .map_err(|e| TrainError::io(&self.path, e))?;
            }
        }
        parse(&self.path, i + 1, &bytes)
    }
}

fn parse<T: DeserializeOwned>(path: &Path, number: usize, bytes: &[u8]) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|e| TrainError::Malformed {
        path: path.to_path_buf(),
        reason: format!("line {number}: {e}"),
    })
}

/// Reads a whole JSON-lines file that a killed run may have left with a torn last line: the
/// complete lines are parsed and returned, and a trailing partial line is cut off the file, so
/// that appending continues from a clean end. A missing file is an empty log. (For large logs,
/// [`LineIndex`] reads lines on demand instead.)
pub fn recover_jsonl<T: DeserializeOwned>(path: &Path) -> Result<Vec<T>> {
    let mut records = Vec::new();
    let index = LineIndex::recover(path, |_: &serde_json::Value| ())?;
    for i in 0..index.len() {
        records.push(index.read(i)?);
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    struct Rec {
        id: usize,
        tokens: Vec<u32>,
    }

    #[test]
    fn lines_read_back_by_index_and_a_torn_tail_is_cut() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log.jsonl");
        let recs: Vec<Rec> = (0..5)
            .map(|id| Rec {
                id,
                tokens: (0..id as u32 * 3).collect(),
            })
            .collect();
        let mut text: String = recs
            .iter()
            .map(|r| serde_json::to_string(r).unwrap() + "\n")
            .collect();
        text.push('\n'); // a blank line is skipped
        let whole = text.len() as u64;
        text.push_str("{\"id\": 9, \"tok"); // torn by a kill
        std::fs::write(&path, &text).unwrap();

        let index = LineIndex::recover(&path, |r: &Rec| r.id).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), whole);
        assert_eq!(index.keys().copied().collect::<Vec<_>>(), [0, 1, 2, 3, 4]);
        for i in [3, 0, 4, 1] {
            assert_eq!(index.read::<Rec>(i).unwrap(), recs[i]);
        }
        assert!(index.read::<Rec>(5).is_err());
        assert_eq!(recover_jsonl::<Rec>(&path).unwrap(), recs);
        // Missing: empty. Garbage: an error naming the line.
        let missing = LineIndex::recover(&dir.path().join("none"), |r: &Rec| r.id).unwrap();
        assert!(missing.is_empty());
        std::fs::write(&path, "{\"id\": 1, \"tokens\": []}\nnot json\n").unwrap();
        let err = LineIndex::recover(&path, |r: &Rec| r.id).unwrap_err();
        assert!(err.to_string().contains("line 2"), "{err}");
    }
}

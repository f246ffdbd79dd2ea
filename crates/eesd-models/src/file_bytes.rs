//! The bytes of a model file. Weight files (GGUF, safetensors) are memory-mapped rather than read:
//! their tensors are converted into the model's own layout anyway, so a heap copy of a file that
//! can be hundreds of MB only doubled the memory a load needs. Small files (JSON, tokenizers) are
//! read. Either way only regular files are opened: a path to a device or a pipe (`/dev/zero`)
//! would otherwise be read until memory runs out.

use std::io::{Error as IoError, ErrorKind};
use std::ops::Deref;
use std::path::Path;

use crate::error::{ModelError, Result};

/// A file's bytes: mapped from disk or owned.
pub enum FileBytes {
    /// Read-only private mapping of a regular file.
    Mapped(memmap2::Mmap),
    /// Bytes in memory (from a caller, or an empty file, which cannot be mapped).
    Owned(Vec<u8>),
}

impl FileBytes {
    /// Maps a regular file read-only.
    ///
    /// The mapping lives while the model is built from it. As with every memory-mapped loader
    /// (llama.cpp, safetensors), another process that truncates the file during that time makes
    /// the read fault; a file that is only read is safe. Every offset read through it is
    /// checked against the length the file had when it was mapped.
    pub fn map(path: &Path) -> Result<Self> {
        let (file, len) = open_regular(path)?;
        if len == 0 {
            return Ok(FileBytes::Owned(Vec::new()));
        }
        // SAFETY: read-only private mapping of a regular file opened above; see the doc comment
        // for the one hazard (truncation by another process while loading).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        Ok(FileBytes::Mapped(map))
    }
}

impl Deref for FileBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            FileBytes::Mapped(map) => map,
            FileBytes::Owned(bytes) => bytes,
        }
    }
}

impl From<Vec<u8>> for FileBytes {
    fn from(bytes: Vec<u8>) -> Self {
        FileBytes::Owned(bytes)
    }
}

/// Reads a small regular file (JSON, tokenizer) into memory.
pub fn read(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let (mut file, len) = open_regular(path)?;
    let mut bytes = Vec::with_capacity(len.try_into().unwrap_or(0));
    file.read_to_end(&mut bytes)
        .map_err(|e| ModelError::io(path, e))?;
    Ok(bytes)
}

/// Reads a small regular text file.
pub fn read_to_string(path: &Path) -> Result<String> {
    String::from_utf8(read(path)?).map_err(|_| {
        ModelError::io(
            path,
            IoError::new(ErrorKind::InvalidData, "stream did not contain valid UTF-8"),
        )
    })
}

/// Opens `path` if it is a regular file, with its length.
pub(crate) fn open_regular(path: &Path) -> Result<(std::fs::File, u64)> {
    let file = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
    let meta = file.metadata().map_err(|e| ModelError::io(path, e))?;
    if !meta.is_file() {
        return Err(ModelError::io(
            path,
            IoError::new(ErrorKind::InvalidInput, "not a regular file"),
        ));
    }
    Ok((file, meta.len()))
}

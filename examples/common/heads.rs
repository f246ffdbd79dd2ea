//! Head arguments of the examples: `shipped` names the head in `assets/heads`, anything else is
//! a checkpoint prefix (`PREFIX.safetensors` + `PREFIX.json`).

// Each example includes this module and uses the kinds of head it drafts with.
#![allow(dead_code)]

use std::path::Path;

/// The checkpoint prefix of a chain (exit) head argument.
pub fn chain(name: &str) -> &Path {
    Path::new(match name {
        "shipped" => eesd::SHIPPED_HEAD,
        prefix => prefix,
    })
}

/// The checkpoint prefix of a lookahead (tree) head argument.
pub fn lookahead(name: &str) -> &Path {
    Path::new(match name {
        "shipped" => eesd::SHIPPED_LOOKAHEAD_HEAD,
        prefix => prefix,
    })
}

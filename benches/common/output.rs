//! The output flags every bench binary takes.

/// `--json`, and the `--bench` flag that `cargo bench` passes to every bench binary.
#[derive(clap::Args, Debug)]
pub struct Output {
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// cargo bench passes --bench; accept and ignore it.
    #[arg(long, hide = true)]
    pub bench: bool,
}

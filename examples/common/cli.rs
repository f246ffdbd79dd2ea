//! Argument parsers shared by the examples.

/// A count that must be at least one (`--reps 0` or `--max-new-tokens 0` would measure
/// nothing and print NaN ratios): clap reports 0 as an invalid value.
pub fn at_least_one(arg: &str) -> Result<usize, String> {
    match arg.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

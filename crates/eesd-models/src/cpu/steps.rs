//! Where a decoder layer's time goes on flex: the wall time of each step of the fused layer
//! (norms, the four products, RoPE, attention, gating, residuals), summed over layers and
//! calls while switched on ([`record`]), read and reset with [`take`]
//! (`block_cost --steps`).
//!
//! Why: a block's cost beside one token's is what speculation lives on, and at 8 rows the steps
//! between the products and attention are a third of it; a profiler's samples spread them over
//! inlined kernels and threads, while these are the calling thread's own clock per step.
//! Switched off (the default) a step costs one relaxed atomic load.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// A step of the fused decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// RMS norm before attention (and its 8-bit rows for a quantized product).
    AttnNorm,
    /// The fused q/k/v product.
    Qkv,
    /// RoPE on the new queries and keys.
    Rope,
    /// Appending keys and values to the cache, and attention.
    Attention,
    /// The attended rows quantized for a quantized output projection.
    AttendedQuant,
    /// The output projection.
    OutProj,
    /// The residual additions made on their own (the MLP's, or the attention's in a layer
    /// without its MLP half).
    Residual,
    /// The attention's residual added, then RMS norm before the MLP (and its 8-bit rows).
    MlpNorm,
    /// The fused gate and up product.
    GateUp,
    /// SwiGLU (and the down projection's 8-bit rows).
    Gating,
    /// The down projection.
    Down,
}

impl Step {
    /// Every step, in a layer's order.
    pub const ALL: [Step; 11] = [
        Step::AttnNorm,
        Step::Qkv,
        Step::Rope,
        Step::Attention,
        Step::AttendedQuant,
        Step::OutProj,
        Step::Residual,
        Step::MlpNorm,
        Step::GateUp,
        Step::Gating,
        Step::Down,
    ];

    /// A short name (JSON keys, tables).
    pub fn name(self) -> &'static str {
        match self {
            Step::AttnNorm => "attn_norm",
            Step::Qkv => "qkv",
            Step::Rope => "rope",
            Step::Attention => "attention",
            Step::AttendedQuant => "attended_q8",
            Step::OutProj => "out_proj",
            Step::Residual => "residual",
            Step::MlpNorm => "mlp_norm",
            Step::GateUp => "gate_up",
            Step::Gating => "gating",
            Step::Down => "down",
        }
    }
}

static ON: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; Step::ALL.len()] = [const { AtomicU64::new(0) }; Step::ALL.len()];

/// Switches the timing of steps on or off (process-wide).
pub fn record(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

/// Seconds spent in each step since the last call, in [`Step::ALL`]'s order; resets them.
pub fn take() -> Vec<(Step, f64)> {
    Step::ALL
        .iter()
        .zip(&NANOS)
        .map(|(&step, n)| (step, n.swap(0, Ordering::Relaxed) as f64 * 1e-9))
        .collect()
}

/// A clock over consecutive steps of one layer: each [`Laps::done`] charges the time since the
/// previous one to a step. Inert unless [`record`] was switched on when it started.
#[cfg_attr(not(feature = "flex"), allow(dead_code))] // used by the flex decoder only
pub(crate) struct Laps(Option<Instant>);

#[cfg_attr(not(feature = "flex"), allow(dead_code))] // used by the flex decoder only
impl Laps {
    pub(crate) fn start() -> Laps {
        Laps(ON.load(Ordering::Relaxed).then(Instant::now))
    }

    /// Charges the time since the previous lap to `step`.
    pub(crate) fn done(&mut self, step: Step) {
        if let Some(last) = &mut self.0 {
            let now = Instant::now();
            let nanos = now.duration_since(*last).as_nanos();
            NANOS[step as usize]
                .fetch_add(u64::try_from(nanos).unwrap_or(u64::MAX), Ordering::Relaxed);
            *last = now;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn laps_charge_their_steps_only_while_recording() {
        // The only test that switches recording on (forwards of other tests running meanwhile
        // may add to any step, never take away).
        assert!(Laps::start().0.is_none());
        record(true);
        let mut laps = Laps::start();
        std::thread::sleep(std::time::Duration::from_millis(2));
        laps.done(Step::Down);
        record(false);
        let times = take();
        let down = times.iter().find(|(s, _)| *s == Step::Down).map(|t| t.1);
        assert!(down.is_some_and(|s| s >= 0.002), "{times:?}");
        let mut off = Laps::start();
        assert!(off.0.is_none());
        off.done(Step::Down);
        assert_eq!(Step::ALL.map(|s| s as usize), std::array::from_fn(|i| i));
    }
}

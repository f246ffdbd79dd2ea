//! The policies against simulated acceptance processes, with fixed seeds (no flakiness: every
//! run sees the same rounds and the same policy draws).

use eesd_bandit::{
    BetaTs, CalibratedTs, CostAwareTs, Costs, Decision, DraftPolicy, DraftStep, Policy, Process,
    RoundOutcome, oracle_fixed, simulate,
};

/// A dropped draft costs the head's evaluation only, about a quarter of a draft step
/// (measured on SmolLM2-135M with an 8k-token draft vocabulary at exit layer 6).
const DISCARD_SHARE: f64 = 0.27;

const ROUNDS: usize = 20_000;
const SEED: u64 = 42;

fn ts_policies(ratio: f64) -> Vec<Box<dyn DraftPolicy>> {
    vec![
        Box::new(BetaTs::new(SEED).with_cost_ratio(ratio).unwrap()),
        Box::new(CalibratedTs::new(SEED).with_cost_ratio(ratio).unwrap()),
        Box::new(CostAwareTs::new(SEED).with_cost_ratio(ratio).unwrap()),
    ]
}

#[test]
fn beta_posterior_converges_to_the_true_acceptance_rate() {
    for theta in [0.3, 0.7, 0.9] {
        let mut p = BetaTs::new(SEED);
        simulate(
            &mut p,
            &Process::Stationary { theta },
            5_000,
            Costs {
                draft: 0.1,
                verify: 1.0,
                discard: 0.1 * DISCARD_SHARE,
            },
            SEED,
        );
        let mean = p.posterior().mean();
        assert!(
            (mean - theta).abs() < 0.02,
            "θ = {theta}: posterior mean {mean}"
        );
        let (lo, hi) = p.posterior().credible_interval(0.99);
        assert!(
            lo < theta && theta < hi && hi - lo < 0.1,
            "θ = {theta}: 99% interval ({lo}, {hi})"
        );
    }
}

#[test]
fn calibration_curve_converges_to_the_true_curve() {
    let mut p = CalibratedTs::new(SEED);
    let process = Process::ConfidenceDependent {
        a: 1.0,
        b: 1.0,
        power: 1.0,
    };
    simulate(
        &mut p,
        &process,
        ROUNDS,
        Costs {
            draft: 0.05,
            verify: 1.0,
            discard: 0.05 * DISCARD_SHARE,
        },
        SEED,
    );
    let bins = p.posterior();
    for b in 0..bins.len() {
        let post = bins.posterior(b);
        let centre = (b as f64 + 0.5) / bins.len() as f64;
        if post.alpha + post.beta > 200.0 {
            assert!(
                (post.mean() - centre).abs() < 0.06,
                "bin {b}: {} vs {centre}",
                post.mean()
            );
        }
    }
}

#[test]
fn thompson_sampling_reaches_95_percent_of_the_best_fixed_length_on_stationary_processes() {
    // θ = 0.15 at cost 0.3: drafting does not pay and the best 'fixed length' is 0 (plain AR).
    for theta in [0.15, 0.5, 0.75, 0.9] {
        for draft in [0.1, 0.3] {
            let costs = Costs {
                draft,
                verify: 1.0,
                discard: draft * DISCARD_SHARE,
            };
            let process = Process::Stationary { theta };
            let oracle = oracle_fixed(&process, ROUNDS, costs, SEED, 8);
            for mut p in ts_policies(draft) {
                let r = simulate(p.as_mut(), &process, ROUNDS, costs, SEED);
                assert!(
                    r.score >= 0.95 * oracle.score,
                    "{} on θ={theta}, draft cost {draft}: {:.3} < 95% of {} ({:.3})",
                    r.policy,
                    r.score,
                    oracle.policy,
                    oracle.score
                );
            }
        }
    }
}

#[test]
fn calibrated_and_cost_aware_ts_beat_the_best_fixed_length_when_confidence_is_informative() {
    let costs = Costs {
        draft: 0.15,
        verify: 1.0,
        discard: 0.15 * DISCARD_SHARE,
    };
    for process in [
        Process::ConfidenceDependent {
            a: 0.6,
            b: 0.4,
            power: 1.0,
        },
        Process::ConfidenceDependent {
            a: 2.0,
            b: 1.0,
            power: 2.0,
        },
    ] {
        let oracle = oracle_fixed(&process, ROUNDS, costs, SEED, 8);
        let policies: Vec<Box<dyn DraftPolicy>> = vec![
            Box::new(CalibratedTs::new(SEED).with_cost_ratio(0.15).unwrap()),
            Box::new(CostAwareTs::new(SEED).with_cost_ratio(0.15).unwrap()),
        ];
        for mut p in policies {
            let r = simulate(p.as_mut(), &process, ROUNDS, costs, SEED);
            assert!(
                r.score > 1.02 * oracle.score,
                "{} on {}: {:.3} vs best fixed {} {:.3}",
                r.policy,
                process.label(),
                r.score,
                oracle.policy,
                oracle.score
            );
        }
    }
}

#[test]
fn discounting_wins_when_acceptance_switches() {
    let costs = Costs {
        draft: 0.15,
        verify: 1.0,
        discard: 0.15 * DISCARD_SHARE,
    };
    let process = Process::Switching {
        thetas: vec![0.9, 0.3],
        segment: 300,
    };
    let plain = simulate(&mut BetaTs::new(SEED), &process, ROUNDS, costs, SEED);
    let discounted = simulate(
        &mut BetaTs::new(SEED).with_discount(0.98).unwrap(),
        &process,
        ROUNDS,
        costs,
        SEED,
    );
    assert!(
        discounted.score > 1.05 * plain.score,
        "{} vs {}",
        discounted.score,
        plain.score
    );
}

#[test]
fn censored_rounds_add_no_failure() {
    let mut p = BetaTs::new(1);
    let before = p.posterior().clone();
    p.observe(&RoundOutcome {
        drafted: 3,
        accepted: 3,
        confidences: vec![0.9; 3],
        cost_ratio: None,
    });
    assert_eq!(p.posterior().alpha, before.alpha + 3.0);
    assert_eq!(p.posterior().beta, before.beta);
    p.observe(&RoundOutcome {
        drafted: 5,
        accepted: 1,
        confidences: vec![0.9; 5],
        cost_ratio: None,
    });
    assert_eq!(p.posterior().alpha, before.alpha + 4.0);
    assert_eq!(
        p.posterior().beta,
        before.beta + 1.0,
        "only the first rejection is observed"
    );
}

#[test]
fn policies_are_deterministic_and_survive_serialisation() {
    let costs = Costs {
        draft: 0.2,
        verify: 1.0,
        discard: 0.2 * DISCARD_SHARE,
    };
    let process = Process::ConfidenceDependent {
        a: 0.6,
        b: 0.4,
        power: 1.0,
    };
    for spec in [
        "beta-ts",
        "calibrated-ts",
        "cost-ts",
        "beta-ts:0.95",
        "fixed:3",
        "threshold:0.4",
    ] {
        let mut a = Policy::parse(spec, 9).unwrap();
        let mut b = Policy::parse(spec, 9).unwrap();
        assert_eq!(
            simulate(&mut a, &process, 500, costs, 1),
            simulate(&mut b, &process, 500, costs, 1)
        );
        // Save after training, restore, and both continue identically.
        let json = serde_json::to_string(&a).unwrap();
        let mut restored: Policy = serde_json::from_str(&json).unwrap();
        assert_eq!(restored, a, "{spec}");
        let ra = simulate(&mut a, &process, 300, costs, 2);
        let rb = simulate(&mut restored, &process, 300, costs, 2);
        assert_eq!(ra, rb, "{spec}");
    }
}

#[test]
fn the_cap_is_respected_and_bad_specs_are_errors() {
    let mut p = Policy::parse("fixed:3", 0).unwrap();
    let step = |position| DraftStep {
        position,
        confidence: 1.0,
        entropy: None,
    };
    assert_eq!(p.decide(&step(1)), Decision::Continue);
    assert_eq!(p.decide(&step(2)), Decision::Stop);
    let mut ts = BetaTs::new(0)
        .with_max_draft(2)
        .unwrap()
        .with_prior(1000.0, 1.0)
        .unwrap();
    ts.begin_round();
    assert_eq!(ts.decide(&step(1)), Decision::Stop);
    for bad in ["fixed", "threshold:1.5", "beta-ts:0", "beta-ts:x", "medusa"] {
        assert!(Policy::parse(bad, 0).is_err(), "{bad}");
    }
    assert!(BetaTs::new(0).with_prior(0.0, 1.0).is_err());
    assert!(CalibratedTs::new(0).with_bins(0, 1.0, 1.0).is_err());
}

#[test]
fn calibrated_policies_drop_likely_rejections_and_keep_confident_drafts() {
    let costs = Costs {
        draft: 0.25,
        verify: 1.0,
        discard: 0.25 * DISCARD_SHARE,
    };
    // Acceptance = confidence²: a 0.1-confidence draft is almost never accepted.
    let process = Process::ConfidenceDependent {
        a: 2.0,
        b: 1.0,
        power: 2.0,
    };
    for spec in ["calibrated-ts", "cost-ts"] {
        let mut p = Policy::parse(spec, 4).unwrap();
        simulate(&mut p, &process, 3000, costs, 3);
        let at = |confidence| DraftStep {
            position: 0,
            confidence,
            entropy: None,
        };
        let (mut dropped_low, mut dropped_high) = (0, 0);
        for _ in 0..50 {
            p.begin_round();
            dropped_low += (p.decide(&at(0.05)) == Decision::Discard) as usize;
            p.begin_round();
            dropped_high += (p.decide(&at(0.99)) == Decision::Discard) as usize;
        }
        assert!(
            dropped_low >= 45,
            "{spec}: dropped {dropped_low}/50 low-confidence drafts"
        );
        assert!(
            dropped_high <= 2,
            "{spec}: dropped {dropped_high}/50 confident drafts"
        );
    }
}

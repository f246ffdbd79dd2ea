//! The verification rules on synthetic distributions: greedy picks the right prefix, and
//! speculative sampling emits tokens distributed exactly as the target (chi-square tests with
//! fixed seeds).

use eesd_core::Sampler;
use eesd_core::accept::{Verdict, accept_greedy, accept_sampling};
use statrs::distribution::{ChiSquared, ContinuousCDF};

fn normalise(v: &[f32]) -> Vec<f32> {
    let s: f32 = v.iter().sum();
    v.iter().map(|x| x / s).collect()
}

/// p-value of Pearson's chi-square goodness-of-fit test.
fn chi_square_p(counts: &[usize], probs: &[f32]) -> f64 {
    let n: usize = counts.iter().sum();
    let mut stat = 0.0;
    let mut df = 0;
    for (&c, &p) in counts.iter().zip(probs) {
        if p > 0.0 {
            let e = n as f64 * p as f64;
            stat += (c as f64 - e).powi(2) / e;
            df += 1;
        } else {
            assert_eq!(c, 0, "a zero-probability token was emitted");
        }
    }
    1.0 - ChiSquared::new((df - 1) as f64).unwrap().cdf(stat)
}

#[test]
fn greedy_accepts_the_matching_prefix() {
    let row = |best: usize| {
        let mut v = vec![0.0f32; 5];
        v[best] = 1.0;
        v
    };
    let target = vec![row(1), row(2), row(4), row(0)];
    assert_eq!(
        accept_greedy(&[1, 2, 3], &target),
        Verdict {
            accepted: 2,
            next: 4
        }
    );
    assert_eq!(
        accept_greedy(&[1, 2, 4], &target),
        Verdict {
            accepted: 3,
            next: 0
        }
    );
    assert_eq!(
        accept_greedy(&[0, 2, 4], &target),
        Verdict {
            accepted: 0,
            next: 1
        }
    );
    assert_eq!(
        accept_greedy(&[], &target[..1]),
        Verdict {
            accepted: 0,
            next: 1
        }
    );
}

#[test]
fn speculative_sampling_emits_the_target_distribution() {
    let p = normalise(&[0.30, 0.05, 0.20, 0.0, 0.15, 0.10, 0.05, 0.10, 0.03, 0.02]);
    // Draft distributions that disagree with p in different ways, including mass where p has none
    // and no mass where p has some.
    let drafts = [
        normalise(&[0.1, 0.3, 0.1, 0.2, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05]),
        normalise(&[0.0, 0.0, 0.5, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0]),
        p.clone(),
    ];
    for (case, q) in drafts.iter().enumerate() {
        let mut sampler = Sampler::new(1234 + case as u64);
        let n = 60_000;
        let (mut first, mut second) = (vec![0usize; 10], vec![0usize; 10]);
        for _ in 0..n {
            // Two drafts from q, verified against the same p at both positions (plus the bonus).
            let d = [sampler.categorical(q) as u32, sampler.categorical(q) as u32];
            let v = accept_sampling(
                &d,
                &[q.clone(), q.clone()],
                &[p.clone(), p.clone(), p.clone()],
                &mut sampler,
            );
            let emitted: Vec<u32> = d[..v.accepted].iter().copied().chain([v.next]).collect();
            first[emitted[0] as usize] += 1;
            if let Some(&t) = emitted.get(1) {
                second[t as usize] += 1;
            }
        }
        let p1 = chi_square_p(&first, &p);
        let p2 = chi_square_p(&second, &p);
        assert!(
            p1 > 1e-3,
            "draft {case}: first token deviates from p (p-value {p1})"
        );
        assert!(
            p2 > 1e-3,
            "draft {case}: second token deviates from p (p-value {p2})"
        );
    }
}

#[test]
fn identical_draft_and_target_accept_everything() {
    let p = normalise(&[0.5, 0.3, 0.2]);
    let mut sampler = Sampler::new(5);
    for _ in 0..1000 {
        let d = [sampler.categorical(&p) as u32];
        let v = accept_sampling(
            &d,
            std::slice::from_ref(&p),
            &[p.clone(), p.clone()],
            &mut sampler,
        );
        assert_eq!(v.accepted, 1);
    }
}

//! SVG plots for the examples (plotters, no font files needed): bars for `spec_bench`, lines for
//! `eval_exit_head`. Each example includes this file and uses part of it.
#![allow(dead_code)]

use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::prelude::*;

/// One bar per series at every x label, series side by side, with a legend.
pub fn grouped_bars(
    path: &Path,
    title: &str,
    x_labels: &[String],
    y_desc: &str,
    series: &[(String, Vec<f64>)],
) -> Result<()> {
    let err = |e: &dyn std::fmt::Display| anyhow!("{}: {e}", path.display());
    let groups = x_labels.len().max(1);
    let width = (groups * (series.len() * 14 + 30)).clamp(640, 1800) as u32;
    let top = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(0f64, f64::max)
        .max(1e-9)
        * 1.15;
    let root = SVGBackend::new(path, (width, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(70)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..groups as f64, 0f64..top)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(groups * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - i as f64 - 0.5).abs() < 1e-6 && i < x_labels.len() {
                x_labels[i].clone()
            } else {
                String::new()
            }
        })
        .y_desc(y_desc)
        .draw()
        .map_err(|e| err(&e))?;
    let slot = 0.8 / series.len().max(1) as f64;
    for (s, (name, values)) in series.iter().enumerate() {
        let color = Palette99::pick(s).to_rgba();
        chart
            .draw_series(values.iter().enumerate().map(|(g, &v)| {
                let x0 = g as f64 + 0.1 + s as f64 * slot;
                Rectangle::new([(x0, 0.0), (x0 + slot * 0.9, v)], color.filled())
            }))
            .map_err(|e| err(&e))?
            .label(name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// Fractions of a histogram's total, padded with zeros to `len` bins.
pub fn fractions(histogram: &[usize], len: usize) -> Vec<f64> {
    let total = histogram.iter().sum::<usize>().max(1) as f64;
    (0..len)
        .map(|i| histogram.get(i).copied().unwrap_or(0) as f64 / total)
        .collect()
}

/// One line with point markers per series (x ascending), with a legend.
pub fn lines(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<()> {
    let err = |e: &dyn std::fmt::Display| anyhow!("{}: {e}", path.display());
    let points = || series.iter().flat_map(|(_, p)| p.iter().copied());
    let x_max = points().map(|p| p.0).fold(0f64, f64::max).max(1e-9) * 1.05;
    let y_max = points().map(|p| p.1).fold(0f64, f64::max).max(1e-9) * 1.15;
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(50)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()
        .map_err(|e| err(&e))?;
    for (s, (name, values)) in series.iter().enumerate() {
        let color = Palette99::pick(s).to_rgba();
        chart
            .draw_series(LineSeries::new(
                values.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|e| err(&e))?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 14, y)], color.stroke_width(2)));
        chart
            .draw_series(values.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

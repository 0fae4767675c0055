//! The entropy-law decile plot (glance.md §7) as a PNG: per task, mean accepted length against
//! mean root entropy for each entropy decile (points joined by a thick line), with the fitted
//! finite-horizon curve of that task (thin line). plotters draws the chart; the labels are drawn
//! with the 8x8 bitmap font afterwards, so no system font is needed.

use std::path::Path;

use glance_spec::law::{expected_accepted, Decile, Fit};
use image::RgbImage;
use plotters::prelude::*;

/// One curve of the plot.
pub struct Series<'a> {
    pub name: &'a str,
    pub deciles: &'a [Decile],
    /// The finite-horizon fit, drawn as a curve when present.
    pub fit: Option<&'a Fit>,
}

const WIDTH: u32 = 900;
const HEIGHT: u32 = 560;
const LEFT: u32 = 70;
const RIGHT: u32 = 190;
const TOP: u32 = 50;
const BOTTOM: u32 = 60;
const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(90, 90, 90),
];

/// A label to draw once the chart is rendered: top-left pixel, text, colour.
type Label = (i32, i32, String, [u8; 3]);

/// Draws the decile plot of `series` (accepted draft tokens out of `horizon`) to `path`.
pub fn draw(path: &Path, title: &str, series: &[Series], horizon: usize) -> Result<(), String> {
    let x_max = series.iter().flat_map(|s| s.deciles.iter().map(|d| d.entropy)).fold(0.5f64, f64::max);
    let x_max = (x_max * 1.1).ceil();
    let y_max = horizon as f64;
    let mut buffer = vec![255u8; (WIDTH * HEIGHT * 3) as usize];
    let mut labels: Vec<Label> = vec![(LEFT as i32, 16, title.to_string(), [0, 0, 0])];
    {
        let root = BitMapBackend::with_buffer(&mut buffer, (WIDTH, HEIGHT)).into_drawing_area();
        let mut chart = ChartBuilder::on(&root)
            .margin_left(LEFT)
            .margin_right(RIGHT)
            .margin_top(TOP)
            .margin_bottom(BOTTOM)
            .build_cartesian_2d(0f64..x_max, 0f64..y_max)
            .map_err(|e| e.to_string())?;
        let ticks = axes(&mut chart, x_max, y_max)?;
        labels.extend(ticks);
        for (i, s) in series.iter().enumerate() {
            let colour = PALETTE[i % PALETTE.len()];
            let points: Vec<(f64, f64)> = s.deciles.iter().map(|d| (d.entropy, d.accepted)).collect();
            chart
                .draw_series(LineSeries::new(points.clone(), colour.stroke_width(3)))
                .map_err(|e| e.to_string())?;
            chart
                .draw_series(points.iter().map(|&p| Circle::new(p, 4, colour.filled())))
                .map_err(|e| e.to_string())?;
            if let Some(fit) = s.fit {
                let curve = (0..=100).map(|k| {
                    let h = x_max * k as f64 / 100.0;
                    (h, expected_accepted(fit.form, fit.b0, fit.b1, h, horizon))
                });
                chart
                    .draw_series(LineSeries::new(curve, colour.stroke_width(1)))
                    .map_err(|e| e.to_string())?;
            }
            let legend = format!("{} b1={}", s.name, s.fit.map_or("-".into(), |f| format!("{:.2}", f.b1)));
            let y = TOP as i32 + 10 + 24 * i as i32;
            let x = (WIDTH - RIGHT + 14) as i32;
            root.draw(&Rectangle::new([(x, y), (x + 14, y + 8)], colour.filled()))
                .map_err(|e| e.to_string())?;
            labels.push((x + 20, y, legend, [colour.0, colour.1, colour.2]));
        }
        root.present().map_err(|e| e.to_string())?;
    }
    let mut image = RgbImage::from_raw(WIDTH, HEIGHT, buffer).ok_or("plot buffer size")?;
    for (x, y, text, colour) in &labels {
        write_text(&mut image, *x, *y, text, *colour);
    }
    image.save(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// The frame, grid lines and tick marks; returns the tick and axis labels to write.
fn axes<DB: DrawingBackend>(
    chart: &mut ChartContext<
        DB,
        Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
    >,
    x_max: f64,
    y_max: f64,
) -> Result<Vec<Label>, String> {
    let grey = RGBColor(220, 220, 220);
    let mut labels = Vec::new();
    let x_step = if x_max > 4.0 { 1.0 } else { 0.5 };
    let mut x = 0.0;
    while x <= x_max + 1e-9 {
        let line = PathElement::new(vec![(x, 0.0), (x, y_max)], grey);
        chart.draw_series(std::iter::once(line)).map_err(|e| e.to_string())?;
        let (px, py) = chart.backend_coord(&(x, 0.0));
        labels.push((px - 12, py + 8, format!("{x:.1}"), [0, 0, 0]));
        x += x_step;
    }
    for k in (0..=y_max as i64).step_by(if y_max > 8.0 { 3 } else { 1 }) {
        let y = k as f64;
        let line = PathElement::new(vec![(0.0, y), (x_max, y)], grey);
        chart.draw_series(std::iter::once(line)).map_err(|e| e.to_string())?;
        let (px, py) = chart.backend_coord(&(0.0, y));
        labels.push((px - 28, py - 4, format!("{k:>2}"), [0, 0, 0]));
    }
    let frame = [(0.0, 0.0), (x_max, 0.0), (x_max, y_max), (0.0, y_max), (0.0, 0.0)];
    chart.draw_series(std::iter::once(PathElement::new(frame.to_vec(), BLACK))).map_err(|e| e.to_string())?;
    let (left, bottom) = chart.backend_coord(&(0.0, 0.0));
    let (right, top) = chart.backend_coord(&(x_max, y_max));
    labels.push((
        (left + right) / 2 - 140,
        bottom + 30,
        "root entropy H (nats), decile mean".into(),
        [0, 0, 0],
    ));
    labels.push((8, top - 24, "accepted draft tokens per round".into(), [0, 0, 0]));
    Ok(labels)
}

/// Writes `text` with the 8x8 bitmap font at 1x scale.
fn write_text(image: &mut RgbImage, x: i32, y: i32, text: &str, colour: [u8; 3]) {
    for (i, c) in text.chars().enumerate() {
        let rows = font8x8::legacy::BASIC_LEGACY[(c as usize) & 0x7f];
        for (row, bits) in rows.iter().enumerate() {
            for col in 0..8 {
                let (px, py) = (x + 8 * i as i32 + col, y + row as i32);
                // font8x8 stores the leftmost pixel in bit 0.
                if bits & (1 << col) != 0
                    && px >= 0
                    && py >= 0
                    && (px as u32) < image.width()
                    && (py as u32) < image.height()
                {
                    image.put_pixel(px as u32, py as u32, image::Rgb(colour));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use glance_spec::law::{deciles, fit, Form, Round};

    #[test]
    fn draws_a_png_with_curves_and_labels() {
        let rounds: Vec<Round> = (0..400)
            .map(|i| {
                let h = (i % 40) as f64 / 10.0;
                Round { entropy: h, accepted: (12.0 - 3.0 * h).max(0.0).round() }
            })
            .collect();
        let d = deciles(&rounds);
        let f = fit(Form::FiniteHorizon, &rounds, 15).expect("a fit");
        let path = std::env::temp_dir().join(format!("glance-law-plot-{}.png", std::process::id()));
        draw(&path, "test", &[Series { name: "synthetic", deciles: &d, fit: Some(&f) }], 15).unwrap();
        let image = image::open(&path).unwrap().to_rgb8();
        std::fs::remove_file(&path).ok();
        assert_eq!((image.width(), image.height()), (WIDTH, HEIGHT));
        let blue = image.pixels().filter(|p| p.0 == [31, 119, 180]).count();
        let black = image.pixels().filter(|p| p.0 == [0, 0, 0]).count();
        assert!(blue > 500, "the series is drawn ({blue} px)");
        assert!(black > 500, "frame and labels are drawn ({black} px)");
    }
}

//! The `tojson` filter HF installs in its chat-template environment: Python's
//! `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`. minijinja's
//! own `tojson` differs (HTML-escapes, compact separators), which would change tool prompts.

use std::fmt::Write;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// Formatting options of `json.dumps` that templates pass as keyword arguments.
struct Style {
    ensure_ascii: bool,
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
}

impl Style {
    fn from_kwargs(kwargs: &Kwargs) -> Result<Self, Error> {
        let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
        let indent = kwargs.get::<Option<Value>>("indent")?.and_then(indent_string);
        let separators = kwargs.get::<Option<Vec<String>>>("separators")?;
        let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
        kwargs.assert_all_used()?;
        // Python's default separators depend on whether an indent is given.
        let default_item = if indent.is_some() { "," } else { ", " };
        let (item_separator, key_separator) = match separators.as_deref() {
            Some([item, key]) => (item.clone(), key.clone()),
            Some(_) => return Err(invalid("separators must be a pair")),
            None => (default_item.to_string(), ": ".to_string()),
        };
        Ok(Self { ensure_ascii, indent, item_separator, key_separator, sort_keys })
    }
}

/// `indent` may be a number of spaces or a literal string, like in Python.
fn indent_string(value: Value) -> Option<String> {
    if value.is_none() || value.is_undefined() {
        return None;
    }
    match value.as_str() {
        Some(s) => Some(s.to_string()),
        None => value.as_usize().map(|n| " ".repeat(n)),
    }
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, msg.into())
}

/// The filter registered as `tojson`.
pub fn tojson(value: &Value, kwargs: Kwargs) -> Result<String, Error> {
    let style = Style::from_kwargs(&kwargs)?;
    let mut out = String::new();
    write_value(&mut out, value, &style, 0)?;
    Ok(out)
}

fn write_value(out: &mut String, value: &Value, style: &Style, depth: usize) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, value)?,
        ValueKind::String => write_string(out, value.as_str().unwrap_or(""), style.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => write_seq(out, value, style, depth)?,
        ValueKind::Map => write_map(out, value, style, depth)?,
        kind => return Err(invalid(format!("Object of type {kind} is not JSON serializable"))),
    }
    Ok(())
}

fn write_number(out: &mut String, value: &Value) -> Result<(), Error> {
    if value.is_integer() {
        let _ = write!(out, "{value}");
        return Ok(());
    }
    let float = f64::try_from(value.clone())?;
    out.push_str(&python_float_repr(float));
    Ok(())
}

/// Python's `repr(float)`: shortest round-trip digits, fixed notation for decimal exponents in
/// -4..16, scientific (`1e+16`, `1e-05`) outside.
pub(crate) fn python_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sci = format!("{:e}", x.abs());
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let sign = if x.is_sign_negative() { "-" } else { "" };
    let point = exponent + 1;
    let body =
        if !(-3..=16).contains(&point) { scientific(&digits, exponent) } else { fixed(&digits, point) };
    format!("{sign}{body}")
}

fn scientific(digits: &str, exponent: i32) -> String {
    let (first, rest) = digits.split_at(1);
    let fraction = if rest.is_empty() { String::new() } else { format!(".{rest}") };
    let exp_sign = if exponent < 0 { '-' } else { '+' };
    format!("{first}{fraction}e{exp_sign}{:02}", exponent.abs())
}

fn fixed(digits: &str, point: i32) -> String {
    let len = digits.len() as i32;
    if point <= 0 {
        format!("0.{}{digits}", "0".repeat((-point) as usize))
    } else if point >= len {
        format!("{digits}{}.0", "0".repeat((point - len) as usize))
    } else {
        let (int, frac) = digits.split_at(point as usize);
        format!("{int}.{frac}")
    }
}

fn write_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn write_seq(out: &mut String, value: &Value, style: &Style, depth: usize) -> Result<(), Error> {
    let items: Vec<Value> = value.try_iter()?.collect();
    write_container(out, ('[', ']'), items.len(), style, depth, |out, i| {
        write_value(out, &items[i], style, depth + 1)
    })
}

fn write_map(out: &mut String, value: &Value, style: &Style, depth: usize) -> Result<(), Error> {
    let mut keys: Vec<Value> = value.try_iter()?.collect();
    if style.sort_keys {
        keys.sort();
    }
    write_container(out, ('{', '}'), keys.len(), style, depth, |out, i| {
        let key = &keys[i];
        write_key(out, key, style);
        out.push_str(&style.key_separator);
        write_value(out, &value.get_item(key)?, style, depth + 1)
    })
}

/// Python coerces non-string keys: numbers and booleans to their JSON text, None to "null".
fn write_key(out: &mut String, key: &Value, style: &Style) {
    let text = match key.kind() {
        ValueKind::String => key.as_str().unwrap_or("").to_string(),
        ValueKind::None | ValueKind::Undefined => "null".into(),
        ValueKind::Bool => if key.is_true() { "true" } else { "false" }.into(),
        _ => key.to_string(),
    };
    write_string(out, &text, style.ensure_ascii);
}

fn write_container(
    out: &mut String,
    (open, close): (char, char),
    len: usize,
    style: &Style,
    depth: usize,
    mut write_item: impl FnMut(&mut String, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if len > 0 {
        for i in 0..len {
            if i > 0 {
                out.push_str(&style.item_separator);
            }
            newline_indent(out, style, depth + 1);
            write_item(out, i)?;
        }
        newline_indent(out, style, depth);
    }
    out.push(close);
    Ok(())
}

fn newline_indent(out: &mut String, style: &Style, depth: usize) {
    if let Some(indent) = &style.indent {
        out.push('\n');
        out.push_str(&indent.repeat(depth));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_like_python_repr() {
        let cases = [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (1e16, "1e+16"),
            (1234567890123456.0, "1234567890123456.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-2.5e-7, "-2.5e-07"),
            (123.456, "123.456"),
            (-0.0, "-0.0"),
        ];
        for (x, expected) in cases {
            assert_eq!(python_float_repr(x), expected, "{x}");
        }
    }

    fn dumps(template: &str, ctx: Value) -> String {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", tojson);
        env.render_str(template, ctx).unwrap()
    }

    #[test]
    fn dumps_like_python_json() {
        let ctx = minijinja::context! { x => serde_json::json!({"b": [1, 2.5, null, true], "a": "é\"<\n"}) };
        assert_eq!(dumps("{{ x | tojson }}", ctx.clone()), r#"{"a": "é\"<\n", "b": [1, 2.5, null, true]}"#);
        assert_eq!(
            dumps("{{ x | tojson(indent=2, ensure_ascii=true) }}", ctx),
            "{\n  \"a\": \"\\u00e9\\\"<\\n\",\n  \"b\": [\n    1,\n    2.5,\n    null,\n    true\n  ]\n}"
        );
    }
}

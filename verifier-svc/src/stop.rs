//! Turns generated tokens into text chunks: incremental detokenization that never splits a UTF-8
//! character, and stop strings that end the generation with the stop string itself removed. Text
//! that could still become the start of a stop string is held back until it cannot.

/// Decodes a token sequence to text (the tokenizer, in production).
pub trait Detokenize {
    fn detokenize(&self, ids: &[u32]) -> String;
}

impl<F: Fn(&[u32]) -> String> Detokenize for F {
    fn detokenize(&self, ids: &[u32]) -> String {
        self(ids)
    }
}

pub struct TextAssembler<D> {
    detokenizer: D,
    stops: Vec<String>,
    ids: Vec<u32>,
    /// Bytes of the decoded text already handed out.
    emitted: usize,
    stopped: bool,
}

/// What one new token produced.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Piece {
    /// Text that is now final.
    pub text: String,
    /// A stop string matched: the generation must end with this token.
    pub stop: bool,
}

impl<D: Detokenize> TextAssembler<D> {
    pub fn new(detokenizer: D, stops: Vec<String>) -> Self {
        let stops = stops.into_iter().filter(|s| !s.is_empty()).collect();
        Self {
            detokenizer,
            stops,
            ids: Vec::new(),
            emitted: 0,
            stopped: false,
        }
    }

    /// Adds a generated token (not an end-of-sequence token).
    pub fn push(&mut self, id: u32) -> Piece {
        if self.stopped {
            return Piece {
                text: String::new(),
                stop: true,
            };
        }
        self.ids.push(id);
        let text = self.detokenizer.detokenize(&self.ids);
        if let Some(cut) = self.first_stop(&text) {
            self.stopped = true;
            let piece = text.get(self.emitted..cut).unwrap_or_default().to_string();
            self.emitted = cut;
            return Piece {
                text: piece,
                stop: true,
            };
        }
        let safe = self.safe_end(&text);
        let piece = text.get(self.emitted..safe).unwrap_or_default().to_string();
        self.emitted = self.emitted.max(safe);
        Piece {
            text: piece,
            stop: false,
        }
    }

    /// The rest of the text once the generation has ended for another reason.
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        let text = self.detokenizer.detokenize(&self.ids);
        let end = text.trim_end_matches('\u{FFFD}').len().max(self.emitted);
        let rest = text.get(self.emitted..end).unwrap_or_default().to_string();
        self.emitted = end;
        rest
    }

    fn first_stop(&self, text: &str) -> Option<usize> {
        // Only the unemitted tail (plus overlap) can hold a new match.
        let from = floor_char_boundary(text, self.emitted.saturating_sub(self.longest_stop()));
        self.stops
            .iter()
            .filter_map(|s| text[from..].find(s.as_str()).map(|i| from + i))
            .min()
    }

    fn longest_stop(&self) -> usize {
        self.stops.iter().map(String::len).max().unwrap_or(0)
    }

    /// End of the text that is final: no trailing partial character, and no suffix that is a
    /// prefix of a stop string.
    fn safe_end(&self, text: &str) -> usize {
        let mut end = text.trim_end_matches('\u{FFFD}').len();
        for stop in &self.stops {
            for len in (1..stop.len()).rev() {
                if let Some(prefix) = stop.get(..len) {
                    if text[..end].ends_with(prefix) {
                        end = end.min(text[..end].len() - len);
                        break;
                    }
                }
            }
        }
        end.max(self.emitted)
    }
}

fn floor_char_boundary(text: &str, mut index: usize) -> usize {
    index = index.min(text.len());
    while !text.is_char_boundary(index) {
        index -= 1;
    }
    index
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Token i is the i-th string of the table.
    fn assembler(table: &'static [&'static str], stops: &[&str]) -> TextAssembler<impl Detokenize> {
        let detok = move |ids: &[u32]| ids.iter().map(|&i| table[i as usize]).collect::<String>();
        TextAssembler::new(detok, stops.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn stop_string_across_tokens_is_removed() {
        let mut asm = assembler(&["Hello", " wor", "ld", "<", "/a", ">", " more"], &["</a>"]);
        assert_eq!(asm.push(0).text, "Hello");
        assert_eq!(asm.push(1).text, " wor");
        assert_eq!(asm.push(2).text, "ld");
        assert_eq!(
            asm.push(3),
            Piece {
                text: String::new(),
                stop: false
            }
        );
        assert_eq!(
            asm.push(4),
            Piece {
                text: String::new(),
                stop: false
            }
        );
        assert_eq!(
            asm.push(5),
            Piece {
                text: String::new(),
                stop: true
            }
        );
        assert_eq!(asm.finish(), "");
    }

    #[test]
    fn held_back_text_is_released_when_no_stop_follows() {
        let mut asm = assembler(&["a<", "b", "c"], &["<x"]);
        assert_eq!(asm.push(0).text, "a");
        assert_eq!(asm.push(1).text, "<b");
        assert_eq!(asm.push(2).text, "c");
        assert_eq!(asm.finish(), "");
    }

    #[test]
    fn partial_utf8_waits_for_its_last_byte() {
        let mut asm = assembler(&["caf", "\u{FFFD}", "é"], &[]);
        assert_eq!(asm.push(0).text, "caf");
        // The table is literal here: a real tokenizer yields U+FFFD for an incomplete character.
        assert_eq!(asm.push(1).text, "");
        assert_eq!(asm.finish(), "");
    }

    #[test]
    fn stop_inside_one_token_keeps_the_text_before_it() {
        let mut asm = assembler(&["x", "ab STOP cd"], &["STOP"]);
        assert_eq!(asm.push(0).text, "x");
        assert_eq!(
            asm.push(1),
            Piece {
                text: "ab ".into(),
                stop: true
            }
        );
    }
}

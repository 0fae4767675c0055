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
    /// Decoded text so far (only complete characters).
    text: String,
    /// Incremental decoding window, as TGI does it: the tokens from `prefix_offset` are decoded
    /// again each step (so merges and spaces come out right) and the text past what
    /// `prefix_offset..read_offset` decodes to is new. Cost per token stays constant.
    prefix_offset: usize,
    read_offset: usize,
    /// Bytes of `text` already handed out.
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
            text: String::new(),
            prefix_offset: 0,
            read_offset: 0,
            emitted: 0,
            stopped: false,
        }
    }

    /// Adds a generated token (not an end-of-sequence token).
    pub fn push(&mut self, id: u32) -> Piece {
        if self.stopped {
            return Piece { text: String::new(), stop: true };
        }
        self.ids.push(id);
        self.decode_new_text(false);
        if let Some(cut) = self.first_stop() {
            self.stopped = true;
            let piece = self.text.get(self.emitted..cut).unwrap_or_default().to_string();
            self.emitted = cut;
            return Piece { text: piece, stop: true };
        }
        let safe = self.safe_end();
        let piece = self.text.get(self.emitted..safe).unwrap_or_default().to_string();
        self.emitted = self.emitted.max(safe);
        Piece { text: piece, stop: false }
    }

    /// The rest of the text once the generation has ended for another reason.
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        self.decode_new_text(true);
        let rest = self.text.get(self.emitted..).unwrap_or_default().to_string();
        self.emitted = self.text.len();
        rest
    }

    /// Appends the text the newest tokens completed. While the newest tokens end inside a UTF-8
    /// character (the decoder yields U+FFFD), nothing is appended unless `flush`.
    fn decode_new_text(&mut self, flush: bool) {
        let prefix = self.detokenizer.detokenize(&self.ids[self.prefix_offset..self.read_offset]);
        let window = self.detokenizer.detokenize(&self.ids[self.prefix_offset..]);
        let complete = !window.ends_with('\u{FFFD}');
        if window.len() > prefix.len() && (complete || flush) {
            let new = window.get(prefix.len()..).unwrap_or_default();
            self.text.push_str(new.trim_end_matches('\u{FFFD}'));
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
        }
    }

    fn first_stop(&self) -> Option<usize> {
        // Only the unemitted tail (plus overlap) can hold a new match.
        let text = &self.text;
        let from = floor_char_boundary(text, self.emitted.saturating_sub(self.longest_stop()));
        self.stops.iter().filter_map(|s| text[from..].find(s.as_str()).map(|i| from + i)).min()
    }

    fn longest_stop(&self) -> usize {
        self.stops.iter().map(String::len).max().unwrap_or(0)
    }

    /// End of the text that is final: no suffix that is a prefix of a stop string.
    fn safe_end(&self) -> usize {
        let text = &self.text;
        let mut end = text.len();
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
        assert_eq!(asm.push(3), Piece { text: String::new(), stop: false });
        assert_eq!(asm.push(4), Piece { text: String::new(), stop: false });
        assert_eq!(asm.push(5), Piece { text: String::new(), stop: true });
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
        // Byte-level tokens, decoded like a byte-level BPE decoder does.
        let detok = |ids: &[u32]| {
            String::from_utf8_lossy(&ids.iter().map(|&b| b as u8).collect::<Vec<_>>()).into_owned()
        };
        let mut asm = TextAssembler::new(detok, vec![]);
        let pieces: Vec<String> = "café!".bytes().map(|b| asm.push(b as u32).text).collect();
        assert_eq!(pieces, ["c", "a", "f", "", "é", "!"]);
        assert_eq!(asm.finish(), "");
        // A generation that ends inside a character flushes what there is.
        let mut cut = TextAssembler::new(detok, vec![]);
        assert_eq!(cut.push(b'x' as u32).text, "x");
        assert_eq!(cut.push(0xC3).text, "");
        assert_eq!(cut.finish(), "");
    }

    #[test]
    fn stop_inside_one_token_keeps_the_text_before_it() {
        let mut asm = assembler(&["x", "ab STOP cd"], &["STOP"]);
        assert_eq!(asm.push(0).text, "x");
        assert_eq!(asm.push(1), Piece { text: "ab ".into(), stop: true });
    }
}

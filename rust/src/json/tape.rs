//! Two-stage walks: parse lines into [`Tape`]s on one thread, build them on another.
//!
//! Building Python objects needs the GIL; checking the grammar, parsing numbers and comparing
//! repeated token arrays does not. A large read therefore walks its lines with [`TapeBuilder`]
//! on a second thread (the store's reads and freezes, through a [`tape_channel`], or
//! [`tape_lines`] over a buffer already read) while the caller [`Replay`]s each finished line
//! into its own builder, handing that builder exactly the calls a direct [`super::build`]
//! would have made: the same values, arrays reused from the same earlier arrays, the same
//! errors.
//!
//! A tape holds no borrow of its line: its texts are [`Span`]s of the line, which the replay is
//! handed beside the tape. So a line and its tape can travel as owned values, the line a range
//! of a shared chunk of a streamed read (`crate::ring`), whose buffer is reused once the
//! building thread has built its lines.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{
    channel, sync_channel, Receiver, Sender, SyncSender, TryRecvError, TrySendError,
};
use std::sync::Arc;

use crate::ring::{LineBytes, Shared};

use super::{
    build, extract_call_id, found_call_id, keep_recent, note_call_id, remembers, Builder,
    LineError, Repeats, CALL_ID_KEY,
};

/// Where a text of a tape is in its line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    start: usize,
    end: usize,
}

impl Span {
    /// The text in `line` (the line the tape was made of).
    pub fn of<'a>(&self, line: &'a [u8]) -> &'a [u8] {
        &line[self.start..self.end]
    }
}

/// One value of a line, held in Rust: texts are spans of the line, floats are already parsed
/// (unless the building end parses them: [`TapeFeed::parse_floats_here`]).
#[derive(Debug, Clone)]
pub enum Tape {
    Null,
    Bool(bool),
    /// A plain non-negative integer and its digits.
    Unsigned(u64, Span),
    /// A number with a fraction or an exponent, parsed, and its text.
    Float(f64, Span),
    /// Any other integer (negative, or beyond 64 bits): its text.
    Integer(Span),
    /// A number with a fraction or an exponent left as text, for a builder that parses floats
    /// itself (see [`TapeFeed::parse_floats_here`]).
    FloatText(Span),
    /// A string with its quotes, and whether it holds an escape.
    String(Span, bool),
    Array(Arc<TapeArray>),
    /// Members and nesting depth (1 for a line's top-level object).
    Object(Vec<(Tape, Tape)>, usize),
}

/// An array: its items in order, runs of them taken from earlier arrays of the walk.
#[derive(Debug)]
pub struct TapeArray {
    /// Numbers the arrays of one walk, so a later run can name the array it repeats.
    id: u64,
    parts: Vec<Part>,
    all_unsigned: bool,
    len: usize,
}

#[derive(Debug)]
enum Part {
    Item(Tape),
    /// Plain non-negative integers in a row (the bulk of a token array) and their digits,
    /// packed: no tape value each to build, replay one by one and drop.
    Unsigned(Vec<u64>, Vec<Span>),
    /// Floats in a row (log-probs) and their texts, packed likewise.
    Floats(Vec<f64>, Vec<Span>),
    /// Floats in a row left as text ([`Tape::FloatText`]).
    FloatTexts(Vec<Span>),
    /// The first `count` items of the earlier array `source`.
    Reused {
        source: u64,
        count: usize,
    },
}

/// Builds [`Tape`]s of one line at a time (each walk begins with `start`); see the module
/// documentation.
#[derive(Debug, Default)]
pub struct TapeBuilder {
    next_id: u64,
    /// The address of the first byte of the line being walked: every text the walk hands over
    /// is a slice of that line, and its span is its place in it.
    line: usize,
    /// Leave floats as text ([`Tape::FloatText`]): the replaying builder parses them.
    floats_as_text: bool,
}

impl TapeBuilder {
    /// Walk `line` next.
    fn start(&mut self, line: &[u8]) {
        self.line = line.as_ptr() as usize;
    }

    fn span(&self, text: &[u8]) -> Span {
        let start = (text.as_ptr() as usize).wrapping_sub(self.line);
        Span {
            start,
            end: start + text.len(),
        }
    }
}

/// An array of a [`TapeBuilder`] while its items are walked.
#[derive(Debug, Default)]
pub struct TapeItems {
    parts: Vec<Part>,
    len: usize,
}

impl<'a> Builder<'a> for TapeBuilder {
    type Value = Tape;
    type Items = TapeItems;
    type Error = LineError;

    fn null(&mut self) -> Result<Tape, LineError> {
        Ok(Tape::Null)
    }

    fn boolean(&mut self, value: bool) -> Result<Tape, LineError> {
        Ok(Tape::Bool(value))
    }

    fn unsigned(&mut self, value: u64, text: &'a [u8]) -> Result<Tape, LineError> {
        Ok(Tape::Unsigned(value, self.span(text)))
    }

    fn number(&mut self, text: &'a [u8], integer: bool) -> Result<Tape, LineError> {
        if integer {
            return Ok(Tape::Integer(self.span(text)));
        }
        if self.floats_as_text {
            return Ok(Tape::FloatText(self.span(text)));
        }
        // The walk checked the grammar, so the text is ASCII and parses (possibly to ±inf,
        // exactly as a direct build's parse would).
        let value = std::str::from_utf8(text)
            .ok()
            .and_then(|text| text.parse::<f64>().ok())
            .ok_or_else(|| LineError("invalid float".to_owned()))?;
        Ok(Tape::Float(value, self.span(text)))
    }

    fn string(&mut self, raw: &'a [u8], escaped: bool) -> Result<Tape, LineError> {
        Ok(Tape::String(self.span(raw), escaped))
    }

    fn items(&mut self) -> Result<TapeItems, LineError> {
        Ok(TapeItems::default())
    }

    fn push(&mut self, items: &mut TapeItems, item: Tape) -> Result<(), LineError> {
        items.len += 1;
        let last = items.parts.last_mut();
        match item {
            Tape::Unsigned(value, text) => match last {
                Some(Part::Unsigned(values, texts)) => {
                    values.push(value);
                    texts.push(text);
                }
                _ => items.parts.push(Part::Unsigned(vec![value], vec![text])),
            },
            Tape::Float(value, text) => match last {
                Some(Part::Floats(values, texts)) => {
                    values.push(value);
                    texts.push(text);
                }
                _ => items.parts.push(Part::Floats(vec![value], vec![text])),
            },
            Tape::FloatText(text) => match last {
                Some(Part::FloatTexts(texts)) => texts.push(text),
                _ => items.parts.push(Part::FloatTexts(vec![text])),
            },
            item => items.parts.push(Part::Item(item)),
        }
        Ok(())
    }

    fn reuse(
        &mut self,
        items: &mut TapeItems,
        earlier: &Tape,
        count: usize,
    ) -> Result<(), LineError> {
        let Tape::Array(array) = earlier else {
            return Err(LineError("only arrays are reused".to_owned()));
        };
        items.parts.push(Part::Reused {
            source: array.id,
            count,
        });
        items.len += count;
        Ok(())
    }

    fn array(&mut self, items: TapeItems, all_unsigned: bool) -> Result<Tape, LineError> {
        let id = self.next_id;
        self.next_id += 1;
        Ok(Tape::Array(Arc::new(TapeArray {
            id,
            parts: items.parts,
            all_unsigned,
            len: items.len,
        })))
    }

    fn object(&mut self, members: Vec<(Tape, Tape)>, depth: usize) -> Result<Tape, LineError> {
        Ok(Tape::Object(members, depth))
    }
}

/// One line's walk: its tape, or why the line is not valid JSON.
pub type TapedLine = Result<Tape, LineError>;

/// Walks the lines of one buffer into tapes, in order, repeated arrays reused across lines.
/// After a line that fails, nothing earlier is reused: its arrays were never replayed.
pub struct LineTaper<'a> {
    builder: TapeBuilder,
    repeats: Repeats<'a, Tape>,
}

impl Default for LineTaper<'_> {
    fn default() -> Self {
        Self {
            builder: TapeBuilder::default(),
            repeats: Repeats::new(),
        }
    }
}

impl<'a> LineTaper<'a> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Leave the floats of the lines taped from now on as text, or not.
    pub fn floats_as_text(&mut self, as_text: bool) {
        self.builder.floats_as_text = as_text;
    }

    /// The next line of the walk.
    pub fn tape(&mut self, line: &'a [u8]) -> TapedLine {
        self.builder.start(line);
        let taped = build(line, &mut self.builder, Some(&mut self.repeats));
        if taped.is_err() {
            self.repeats = Repeats::new();
        }
        taped
    }
}

/// [`LineTaper`] over lines in shared chunks (a streamed read, `crate::ring`): the arrays it
/// remembers for later lines hold their chunks, so a chunk goes back to its ring only once no
/// later line can repeat its bytes.
#[derive(Default)]
pub struct ChunkTaper {
    builder: TapeBuilder,
    /// The remembered arrays (most recent first): where their text is, items, tape.
    remembered: Vec<(Shared, Span, usize, Tape)>,
}

impl ChunkTaper {
    pub fn new() -> Self {
        Self::default()
    }

    /// Leave the floats of the lines taped from now on as text, or not.
    pub fn floats_as_text(&mut self, as_text: bool) {
        self.builder.floats_as_text = as_text;
    }

    /// The next line of the walk: `range` of `chunk`.
    pub fn tape(&mut self, chunk: &Shared, range: Range<usize>) -> TapedLine {
        let line = &chunk.bytes()[range];
        let parts = self
            .remembered
            .iter()
            .map(|(held, span, items, tape)| (span.of(held.bytes()), *items, tape.clone()));
        let mut repeats = Repeats::from_parts(parts);
        self.builder.start(line);
        let taped = build(line, &mut self.builder, Some(&mut repeats));
        if taped.is_err() {
            self.remembered.clear();
            return taped;
        }
        // Each remembered text is in this line's chunk or in one it already held.
        let held = std::iter::once(chunk).chain(self.remembered.iter().map(|(held, ..)| held));
        let held: Vec<&Shared> = held.collect();
        let remembered = repeats
            .into_parts()
            .into_iter()
            .filter_map(|(text, items, tape)| {
                let at = text.as_ptr() as usize;
                let (chunk, span) = held.iter().find_map(|chunk| {
                    let start = at.checked_sub(chunk.bytes().as_ptr() as usize)?;
                    let end = start.checked_add(text.len())?;
                    (end <= chunk.bytes().len()).then_some((chunk, Span { start, end }))
                })?;
                Some((Arc::clone(chunk), span, items, tape))
            })
            .collect();
        self.remembered = remembered;
        taped
    }
}

/// The top-level `model_call_id` of `line` from its tape, with the verdicts of
/// [`super::extract_call_id`] on the same line (its walk and a tape's check the same grammar),
/// so a thread that tapes lines need not walk them again for their call ids. A line it refuses
/// (corrupt, so rare) is walked after all, so that the refusal is worded as the walk words it.
pub fn call_id_of(line: &[u8], taped: &TapedLine) -> Result<String, LineError> {
    taped_call_id(line, taped).or_else(|_| extract_call_id(line, None))
}

fn taped_call_id(line: &[u8], taped: &TapedLine) -> Result<String, LineError> {
    let members = match taped {
        Ok(Tape::Object(members, _)) => members,
        Ok(_) => return Err(LineError("expected a JSON object".to_owned())),
        Err(err) => return Err(err.clone()),
    };
    let mut found = None;
    for (key, value) in members {
        if matches!(key, Tape::String(raw, _) if raw.of(line) == CALL_ID_KEY) {
            let span = match value {
                Tape::String(raw, _) => Some(raw.of(line)),
                _ => None,
            };
            note_call_id(&mut found, span)?;
        }
    }
    found_call_id(found)
}

/// Walk the lines at `ranges` of `buf` in order into tapes (see [`LineTaper`]), handing each
/// line with its tape to `emit` until it returns false.
pub fn tape_lines<'a>(
    buf: &'a [u8],
    ranges: &[Range<usize>],
    mut emit: impl FnMut(LineTape<'a>) -> bool,
) {
    let mut taper = LineTaper::new();
    for range in ranges {
        let line = &buf[range.clone()];
        if !emit(LineTape {
            line: LineBytes::Borrowed(line),
            tape: taper.tape(line),
        }) {
            return;
        }
    }
}

/// A complete line and its tape, as a [`tape_channel`] carries them.
pub struct LineTape<'a> {
    pub line: LineBytes<'a>,
    pub tape: TapedLine,
}

impl LineTape<'_> {
    /// The line's bytes.
    pub fn line(&self) -> &[u8] {
        self.line.bytes()
    }
}

/// A channel of lines and their tapes from the walking thread to the building one, `ahead`
/// deep, with a way back: the building thread returns each tape it replayed, and the walking
/// thread frees it. The building thread is the one a two-stage walk waits for; freeing a tape
/// is a walk over its items that the walking thread has time for.
pub fn tape_channel<'a>(ahead: usize) -> (TapeSink<'a>, TapeFeed<'a>) {
    let (tapes, taped) = sync_channel(ahead);
    let (spent, returned) = channel();
    let floats_as_text = Arc::new(AtomicBool::new(false));
    let feed = TapeFeed {
        taped,
        spent,
        side: None,
        floats_as_text: Arc::clone(&floats_as_text),
    };
    let sink = TapeSink {
        tapes,
        returned,
        floats_as_text,
    };
    (sink, feed)
}

/// Work that the building end of a [`tape_channel`] can take over from the walking end (a
/// freeze: hashing lines the walking thread has read, so that it can verify them and start the
/// freeze's syncs sooner).
pub trait SideWork: Sync {
    /// Whether work is pending that the walking end is waiting for (all its lines are read):
    /// a builder does it before it builds its next line (see [`TapeFeed::urgent_side_work`]).
    fn urgent(&self) -> bool;
    /// Do one unit of the work, if any can be done now; false if none.
    fn step(&self) -> bool;
}

/// The walking end of a [`tape_channel`].
pub struct TapeSink<'a> {
    tapes: SyncSender<LineTape<'a>>,
    returned: Receiver<LineTape<'a>>,
    floats_as_text: Arc<AtomicBool>,
}

impl<'a> TapeSink<'a> {
    /// Send the next line, waiting while the channel is full; false once the building end is
    /// gone.
    pub fn send(&self, line: LineTape<'a>) -> bool {
        self.free_returned();
        self.tapes.send(line).is_ok()
    }

    /// Send the next line if the channel has room.
    pub fn try_send(&self, line: LineTape<'a>) -> Result<(), TrySendError<LineTape<'a>>> {
        self.free_returned();
        self.tapes.try_send(line)
    }

    /// Whether the building end parses floats itself: the walking end tapes them as text
    /// (see [`TapeFeed::parse_floats_here`]).
    pub fn floats_as_text(&self) -> bool {
        self.floats_as_text.load(Ordering::Relaxed)
    }

    fn free_returned(&self) {
        self.returned.try_iter().for_each(drop);
    }
}

/// The building end of a [`tape_channel`].
pub struct TapeFeed<'a> {
    taped: Receiver<LineTape<'a>>,
    spent: Sender<LineTape<'a>>,
    side: Option<&'a dyn SideWork>,
    floats_as_text: Arc<AtomicBool>,
}

impl<'a> TapeFeed<'a> {
    /// This feed, whose builder takes over steps of `side`: while it would wait for a line
    /// ([`TapeFeed::iter`]), and all of it once it is urgent ([`TapeFeed::urgent_side_work`]).
    pub fn with_side_work(self, side: &'a dyn SideWork) -> Self {
        TapeFeed {
            side: Some(side),
            ..self
        }
    }

    /// Ask the walking end to leave floats as text from its next line on: this builder parses
    /// them itself. A builder that keeps up with the walk (the columns) takes that work off
    /// the walking thread, which a read waits for; one that is the slower end (Python
    /// objects) does not ask.
    pub fn parse_floats_here(&self) {
        self.floats_as_text.store(true, Ordering::Relaxed);
    }

    /// The side work handed to this feed if it is urgent now: a builder calls this before it
    /// builds each line and, when it answers, does every step of it ([`SideWork::step`] until
    /// false) first. A builder holding a lock other threads want (the GIL) releases it for
    /// the steps: the work is all Rust.
    pub fn urgent_side_work(&self) -> Option<&'a dyn SideWork> {
        self.side.filter(|side| side.urgent())
    }

    /// The lines in order, until the walking end stops sending. While no line is ready, steps
    /// of the side work are done instead of waiting.
    pub fn iter(&self) -> impl Iterator<Item = LineTape<'a>> + '_ {
        std::iter::from_fn(move || loop {
            match self.taped.try_recv() {
                Ok(line) => return Some(line),
                Err(TryRecvError::Disconnected) => return None,
                Err(TryRecvError::Empty) => {
                    if !self.side.is_some_and(|side| side.step()) {
                        return self.taped.recv().ok();
                    }
                }
            }
        })
    }

    /// Return a replayed line to be freed by the walking thread (here, if it is gone).
    pub fn give_back(&self, line: LineTape<'a>) {
        let _ = self.spent.send(line);
    }
}

/// Replays tapes into a builder, in walk order.
pub struct Replay<V> {
    /// The builder's values of the arrays a later run may repeat: those a [`Repeats`] of the
    /// walk remembered, and as many.
    arrays: VecDeque<(u64, V)>,
}

impl<V> Default for Replay<V> {
    fn default() -> Self {
        Self {
            arrays: VecDeque::new(),
        }
    }
}

impl<V: Clone> Replay<V> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Hand `tape` (the next line of the walk, made of `line`) to `builder` as a direct build
    /// would.
    pub fn value<'a, B: Builder<'a, Value = V>>(
        &mut self,
        tape: &Tape,
        line: &'a [u8],
        builder: &mut B,
    ) -> Result<V, B::Error> {
        match tape {
            Tape::Null => builder.null(),
            Tape::Bool(value) => builder.boolean(*value),
            Tape::Unsigned(value, text) => builder.unsigned(*value, text.of(line)),
            Tape::Float(value, text) => builder.float(*value, text.of(line)),
            Tape::Integer(text) => builder.number(text.of(line), true),
            Tape::FloatText(text) => builder.number(text.of(line), false),
            Tape::String(raw, escaped) => builder.string(raw.of(line), *escaped),
            Tape::Array(array) => self.array(array, line, builder),
            Tape::Object(members, depth) => {
                let mut built = Vec::with_capacity(members.len());
                for (key, value) in members {
                    let key = self.value(key, line, builder)?;
                    built.push((key, self.value(value, line, builder)?));
                }
                builder.object(built, *depth)
            }
        }
    }

    /// This replay with its remembered values mapped by `map`, those it answers `None` for
    /// forgotten (a builder whose values borrow their line keeps them across lines of
    /// different buffers this way; a later line repeating a forgotten array fails as a broken
    /// replay).
    pub fn filter_map<W>(self, mut map: impl FnMut(V) -> Option<W>) -> Replay<W> {
        let arrays = self.arrays.into_iter();
        Replay {
            arrays: arrays
                .filter_map(|(id, value)| Some((id, map(value)?)))
                .collect(),
        }
    }

    fn array<'a, B: Builder<'a, Value = V>>(
        &mut self,
        array: &TapeArray,
        line: &'a [u8],
        builder: &mut B,
    ) -> Result<V, B::Error> {
        let mut items = builder.items()?;
        for part in &array.parts {
            match part {
                Part::Item(item) => {
                    let item = self.value(item, line, builder)?;
                    builder.push(&mut items, item)?;
                }
                Part::Unsigned(values, texts) => {
                    builder.push_unsigned_run(&mut items, values, |i| texts[i].of(line))?;
                }
                Part::Floats(values, texts) => {
                    builder.push_float_run(&mut items, values, |i| texts[i].of(line))?;
                }
                Part::FloatTexts(texts) => {
                    builder.push_float_text_run(&mut items, texts.len(), |i| texts[i].of(line))?;
                }
                Part::Reused { source, count } => {
                    let Some((_, earlier)) = self.arrays.iter().find(|(id, _)| id == source) else {
                        return Err(LineError("a repeated array was not replayed".into()).into());
                    };
                    builder.reuse(&mut items, earlier, *count)?;
                }
            }
        }
        let value = builder.array(items, array.all_unsigned)?;
        // What `Repeats::remember` keeps, kept the same way.
        if array.all_unsigned && remembers(array.len) {
            keep_recent(&mut self.arrays, (array.id, value.clone()));
        }
        Ok(value)
    }
}

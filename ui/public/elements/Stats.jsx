// The line(s) under an answer: its statistics and, when older images were left out, which
// images the model saw (ui/app.py finish_answer). An element of its own, not part of the
// message's text, so that the answer's Copy button copies the answer alone.
// props.lines: the lines. Chainlit's SQLAlchemy data layer hands a resumed element's props
// back as the JSON text SQLite stores (chainlit/data/sql_alchemy.py, get_all_user_threads).
export default function Stats() {
  const data = typeof props === "string" ? JSON.parse(props) : props;
  return (
    <div className="answer-stats text-sm italic text-muted-foreground">
      {(data.lines || []).map((line, i) => <div key={i}>{line}</div>)}
    </div>
  );
}
